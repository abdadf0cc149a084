// One decode step's attention over a per-row KV cache: for each row r and kv head c,
//   out[r, c, g, :] = sum_s p[g, s] * v[r, c, s, :],  p[g, :] = softmax over the slots s
//   with ok[r, s] of scale * sum_h q[r, c, g, h] * k[r, c, h, s],
// for the G query heads g that read kv head c. The cache is read only up to the row's last
// slot with ok set, and a slot without ok is never read: a decode step's cache is mostly
// slots not yet written, and XLA:CPU's batched matmuls over the whole width took a quarter
// of a bench-M step (benchmarks/RESULTS.md, "A CPU kernel for decode attention").
//
// Numerics (float32): a score sums h = 0 .. H-1 in order with fused multiply-adds; the
// softmax's max is exact, its sum adds exp(score - max) per lane of 16 consecutive slots
// (slot s in lane s mod 16, chunks in order) and then the 16 lanes in a fixed tree; each
// p is exp(score - max) / sum; the output sums the slots with ok in order. exp is a
// polynomial (Cephes' expf, within 2 ulp of the exact value). None of this depends on
// other rows, on slots past the last one with ok, or on what slots without ok hold.
//
// Built on first use by jaxrlhf/kernels/build.py; registered with XLA as the FFI target
// "jaxrlhf_decode_attention" by jaxrlhf/kernels/decode_attention.py.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // the vector type's width; GCC splits it where the target is narrower
typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec Splat(float x) { return Vec{} + x; }

// Rows of k (slots of v) fetched ahead of their use: one core's misses to memory overlap
// only as far as the loads run ahead, and a head's cache is a few tens of KB.
constexpr int64_t kAhead = 8;

// exp(x) for x <= 0 (a score minus the max): Cephes' expf. x = n ln 2 + r, |r| <= ln 2 / 2,
// exp(r) by a polynomial, 2^n added to the exponent. Below -86 the result is 0 (exp(-86)
// is 4e-38, far below a float's resolution next to the max's term, exp(0) = 1), which
// keeps 2^n a normal number.
inline Vec ExpNonPositive(Vec x) {
  const Vec lo = Splat(-86.0f);
  IVec under = x < lo;
  x = x < lo ? lo : x;
  Vec fx = x * 1.44269504088896341f + 0.5f;
  IVec n = __builtin_convertvector(fx, IVec);
  Vec nf = __builtin_convertvector(n, Vec);
  nf = nf > fx ? nf - 1.0f : nf;  // floor
  n = __builtin_convertvector(nf, IVec);
  Vec r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  Vec r2 = r * r;
  Vec y = Splat(1.9875691500E-4f);
  y = y * r + 1.3981999507E-3f;
  y = y * r + 8.3334519073E-3f;
  y = y * r + 4.1665795894E-2f;
  y = y * r + 1.6666665459E-1f;
  y = y * r + 5.0000001201E-1f;
  y = y * r2 + r + 1.0f;
  IVec bits;
  std::memcpy(&bits, &y, sizeof(y));
  bits += n << 23;
  bits &= ~under;
  std::memcpy(&y, &bits, sizeof(y));
  return y;
}

// scores[g, s] for G <= 4 query heads and NV vectors of slots from s0: q rows at stride
// h_dim, k [H, S] at stride s_dim, scores at stride `stride`. Each score sums h in order.
template <int G, int NV>
void ScoreTile(const float* q, int64_t h_dim, const float* k, int64_t s_dim, int64_t s0,
               float* scores, int64_t stride) {
  Vec acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = Vec{};
  for (int64_t h = 0; h < h_dim; ++h) {
    const float* row = k + h * s_dim + s0;
    for (int j = 0; j < NV; ++j) __builtin_prefetch(row + kAhead * s_dim + j * kLanes, 0, 3);
    Vec kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = Load(row + j * kLanes);
    for (int g = 0; g < G; ++g) {
      Vec qv = Splat(q[g * h_dim + h]);
      for (int j = 0; j < NV; ++j) acc[g][j] += qv * kv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) Store(scores + g * stride + s0 + j * kLanes, acc[g][j]);
}

template <int G>
void Scores(const float* q, int64_t h_dim, const float* k, int64_t s_dim, int64_t end,
            float* scores, int64_t stride) {
  for (int64_t s = 0; s < end;) {
    int64_t left = (end - s) / kLanes;
    if (left >= 4) { ScoreTile<G, 4>(q, h_dim, k, s_dim, s, scores, stride); s += 4 * kLanes; }
    else if (left >= 2) { ScoreTile<G, 2>(q, h_dim, k, s_dim, s, scores, stride); s += 2 * kLanes; }
    else { ScoreTile<G, 1>(q, h_dim, k, s_dim, s, scores, stride); s += kLanes; }
  }
}

// scores[g, s] for every query head and the slots s in [0, end), end % 16 == 0.
void ScoresAnyG(int g_dim, const float* q, int64_t h_dim, const float* k, int64_t s_dim,
                int64_t end, float* scores, int64_t stride) {
  for (int g0 = 0; g0 < g_dim; g0 += 4) {
    const float* qg = q + g0 * h_dim;
    float* sg = scores + g0 * stride;
    switch (std::min(4, g_dim - g0)) {
      case 1: Scores<1>(qg, h_dim, k, s_dim, end, sg, stride); break;
      case 2: Scores<2>(qg, h_dim, k, s_dim, end, sg, stride); break;
      case 3: Scores<3>(qg, h_dim, k, s_dim, end, sg, stride); break;
      default: Scores<4>(qg, h_dim, k, s_dim, end, sg, stride); break;
    }
  }
}

// out[g, :] = sum over the slots s < end with ok[s], in order, of p[g, s] * v[s, :], for
// G <= 4 heads and NV vectors of the head dimension starting at column c.
template <int G, int NV>
void Mix(const float* p, int64_t stride, const bool* ok, int64_t end, const float* v,
         int64_t h_dim, int64_t c, float* out) {
  Vec acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = Vec{};
  for (int64_t s = 0; s < end; ++s) {
    for (int j = 0; j < NV; ++j) __builtin_prefetch(v + (s + kAhead) * h_dim + c + j * kLanes, 0, 3);
    if (!ok[s]) continue;
    Vec vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = Load(v + s * h_dim + c + j * kLanes);
    for (int g = 0; g < G; ++g) {
      Vec pv = Splat(p[g * stride + s]);
      for (int j = 0; j < NV; ++j) acc[g][j] += pv * vv[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) Store(out + g * h_dim + c + j * kLanes, acc[g][j]);
}

template <int G>
void MixColumns(const float* p, int64_t stride, const bool* ok, int64_t end, const float* v,
                int64_t h_dim, float* out) {
  for (int64_t c = 0; c < h_dim;) {
    int64_t left = (h_dim - c) / kLanes;
    if (left >= 4) { Mix<G, 4>(p, stride, ok, end, v, h_dim, c, out); c += 4 * kLanes; }
    else if (left >= 2) { Mix<G, 2>(p, stride, ok, end, v, h_dim, c, out); c += 2 * kLanes; }
    else { Mix<G, 1>(p, stride, ok, end, v, h_dim, c, out); c += kLanes; }
  }
}

void MixAnyG(int g_dim, const float* p, int64_t stride, const bool* ok, int64_t end,
             const float* v, int64_t h_dim, float* out) {
  for (int g0 = 0; g0 < g_dim; g0 += 4) {
    const float* pg = p + g0 * stride;
    float* og = out + g0 * h_dim;
    switch (std::min(4, g_dim - g0)) {
      case 1: MixColumns<1>(pg, stride, ok, end, v, h_dim, og); break;
      case 2: MixColumns<2>(pg, stride, ok, end, v, h_dim, og); break;
      case 3: MixColumns<3>(pg, stride, ok, end, v, h_dim, og); break;
      default: MixColumns<4>(pg, stride, ok, end, v, h_dim, og); break;
    }
  }
}

// 16 slots' ok flags as a lane mask (all bits set where ok).
inline IVec OkMask(const bool* ok) {
  typedef int8_t Bytes __attribute__((vector_size(kLanes)));
  Bytes b;
  std::memcpy(&b, ok, sizeof(b));
  return __builtin_convertvector(b, IVec) != 0;
}

inline float LaneMax(Vec x) {
  float a[kLanes];
  Store(a, x);
  return *std::max_element(a, a + kLanes);
}

// The 16 lanes' sum in a fixed order: halves added pairwise, down to one.
inline float LaneSum(Vec x) {
  float a[kLanes];
  Store(a, x);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) a[i] += a[i + width];
  return a[0];
}

struct Shape {
  int64_t rows, kv, g, h, s;
};

// Row r, kv head c: scores in `scratch` ([G, S rounded up to 16]).
void AttendHead(const Shape& d, float scale, const float* q, const float* k, const float* v,
          const bool* ok, float* out, int64_t r, int64_t c, float* scratch) {
  const bool* row_ok = ok + r * d.s;
  int64_t last = d.s - 1;
  while (last >= 0 && !row_ok[last]) --last;
  const int64_t head = r * d.kv + c;
  float* o = out + head * d.g * d.h;
  if (last < 0) {  // no slot to attend to: softmax over nothing, as 0 (never in a decode)
    std::fill(o, o + d.g * d.h, 0.0f);
    return;
  }
  const int64_t stride = (d.s + kLanes - 1) / kLanes * kLanes;
  // Whole 16-slot chunks up to the last slot with ok; k's row holds at least that many
  // slots only where S % 16 == 0, which decode_attention.py checks.
  const int64_t end = std::min(d.s, (last + kLanes) / kLanes * kLanes);
  ScoresAnyG(static_cast<int>(d.g), q + head * d.g * d.h, d.h, k + head * d.h * d.s, d.s, end,
             scratch, stride);
  const Vec lowest = Splat(-3.402823466e38f);
  for (int64_t g = 0; g < d.g; ++g) {
    float* sg = scratch + g * stride;
    Vec top = lowest;
    for (int64_t s = 0; s < end; s += kLanes) {
      Vec x = Load(sg + s) * scale;
      x = OkMask(row_ok + s) ? x : lowest;
      Store(sg + s, x);
      top = x > top ? x : top;
    }
    const float max = LaneMax(top);
    Vec total{};
    for (int64_t s = 0; s < end; s += kLanes) {
      Vec e = ExpNonPositive(Load(sg + s) - max);
      e = OkMask(row_ok + s) ? e : Vec{};
      Store(sg + s, e);
      total += e;
    }
    const Vec sum = Splat(LaneSum(total));
    for (int64_t s = 0; s < end; s += kLanes) Store(sg + s, Load(sg + s) / sum);
  }
  MixAnyG(static_cast<int>(d.g), scratch, stride, row_ok, end, v + head * d.s * d.h, d.h, o);
}

// (row, kv head) pairs are claimed from a shared counter by the calling thread and by
// helpers on XLA's intra-op pool, as in block_matmul.cc.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  Shape d;
  float scale;
  const float *q, *k, *v;
  const bool* ok;
  float* out;
  void Run() {
    const int64_t stride = (d.s + kLanes - 1) / kLanes * kLanes;
    std::vector<float> scratch(d.g * stride);
    const int64_t heads = d.rows * d.kv;
    for (;;) {
      int64_t i = next.fetch_add(1);
      if (i >= heads) return;
      AttendHead(d, scale, q, k, v, ok, out, i / d.kv, i % d.kv, scratch.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::PRED> ok, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), od = ok.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || od.size() != 2 ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[2] != qd[3] || vd[0] != qd[0] ||
      vd[1] != qd[1] || vd[2] != kd[3] || vd[3] != qd[3] || od[0] != qd[0] ||
      od[1] != kd[3] || qd[3] % kLanes || kd[3] % kLanes)
    return ffi::Error::InvalidArgument(
        "decode_attention: q [R, K, G, H], k [R, K, H, S], v [R, K, S, H], ok [R, S] "
        "(H and S multiples of 16)");
  auto work = std::make_shared<Work>();
  work->d = Shape{qd[0], qd[1], qd[2], qd[3], kd[3]};
  work->scale = scale;
  work->q = q.typed_data(); work->k = k.typed_data(); work->v = v.typed_data();
  work->ok = ok.typed_data(); work->out = out->typed_data();
  const int64_t heads = qd[0] * qd[1];
  int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), heads);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < heads) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlhfDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

// One decode step's attention over a per-row KV cache: for each row r and kv head c,
//   out[r, c, g, :] = sum_s p[g, s] * v[r, c, s, :],  p[g, :] = softmax over the slots s
//   with ok[r, s] of scale * sum_h q[r, c, g, h] * k[r, c, h, s],
// for the G query heads g that read kv head c. A row's cache is read only over the 16-slot
// chunks from its first slot with ok to its last, and a slot without ok changes nothing
// (its score, if computed, is dropped; its value is never read): a decode step's cache is
// mostly slots not yet written, and XLA:CPU's batched matmuls over the whole width took a
// quarter of a bench-M step on an Intel Xeon VM (benchmarks/RESULTS.md, "Intel Xeon: a CPU
// kernel for decode attention").
//
// Numerics (float32): a score sums h = 0 .. H-1 in order (one fused multiply-add per term
// where the target has FMA, -ffp-contract=fast); the softmax's max is exact, its sum adds
// exp(score - max) per lane (slot s in lane s mod 16, chunks in order) and then the 16
// lanes in a fixed tree; each p is exp(score - max) / sum; the output sums the slots with
// ok in order. exp is Cephes' expf polynomial (within 2 ulp). None of this depends on the
// other rows, on the cache's width, or on what slots without ok hold.
//
// A second entry point writes each row's new key and value into its slot first, in place
// (DecodeAttentionWrite): the write then costs little, as the lines it touches are read
// right after.
//
// Built on first use by jaxrlhf/kernels/build.py; registered with XLA as the FFI targets
// "jaxrlhf_decode_attention" and "jaxrlhf_decode_attention_write" by
// jaxrlhf/kernels/decode_attention.py.
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
#if defined(__AVX512F__)
constexpr int kMaxVectors = 4;  // vectors of slots (scores) or of the head (values) per tile
#else
constexpr int kMaxVectors = 1;  // a 16-float vector takes 2-4 narrower registers
#endif
typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef int32_t IVec __attribute__((vector_size(kLanes * 4), aligned(4)));
typedef uint32_t UVec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }
inline Vec Splat(float x) { return Vec{} + x; }

// Rows of k (slots of v) fetched ahead of their use: one core's misses to memory overlap
// only as far as the loads run ahead, and a head's cache is a few tens of KB. (Past a
// head's last row the prefetches reach into the next head's cache, or past the buffer,
// which a prefetch may: it never faults.)
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
  // 2^n into the exponent (n >= -124: stays normal), in unsigned arithmetic, which wraps
  // where a NaN's n would overflow a signed one (the NaN stays a NaN).
  bits = (IVec)((UVec)bits + ((UVec)n << 23));
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

// One partial chunk of n < 16 slots from s0 (the cache's last, where S % 16 != 0): the
// same sums as ScoreTile's, with the missing slots read as 0.
template <int G>
void ScoreTail(const float* q, int64_t h_dim, const float* k, int64_t s_dim, int64_t s0,
               int64_t n, float* scores, int64_t stride) {
  Vec acc[G];
  for (int g = 0; g < G; ++g) acc[g] = Vec{};
  float part[kLanes] = {};
  for (int64_t h = 0; h < h_dim; ++h) {
    std::memcpy(part, k + h * s_dim + s0, n * sizeof(float));
    Vec kv = Load(part);
    for (int g = 0; g < G; ++g) acc[g] += Splat(q[g * h_dim + h]) * kv;
  }
  for (int g = 0; g < G; ++g) Store(scores + g * stride + s0, acc[g]);
}

// Slots [begin, end), both multiples of 16; the chunk past s_dim (if any) is partial.
template <int G>
void Scores(const float* q, int64_t h_dim, const float* k, int64_t s_dim, int64_t begin,
            int64_t end, float* scores, int64_t stride) {
  const int64_t whole = std::min(end, s_dim / kLanes * kLanes);
  for (int64_t s = begin; s < whole;) {
    int64_t left = (whole - s) / kLanes;
    if (kMaxVectors >= 4 && left >= 4) {
      ScoreTile<G, (kMaxVectors >= 4 ? 4 : 1)>(q, h_dim, k, s_dim, s, scores, stride);
      s += 4 * kLanes;
    } else if (kMaxVectors >= 2 && left >= 2) {
      ScoreTile<G, (kMaxVectors >= 2 ? 2 : 1)>(q, h_dim, k, s_dim, s, scores, stride);
      s += 2 * kLanes;
    } else {
      ScoreTile<G, 1>(q, h_dim, k, s_dim, s, scores, stride);
      s += kLanes;
    }
  }
  if (end > whole) ScoreTail<G>(q, h_dim, k, s_dim, whole, s_dim - whole, scores, stride);
}

// scores[g, s] for every query head and the slots s in [begin, end).
void ScoresAnyG(int g_dim, const float* q, int64_t h_dim, const float* k, int64_t s_dim,
                int64_t begin, int64_t end, float* scores, int64_t stride) {
  for (int g0 = 0; g0 < g_dim; g0 += 4) {
    const float* qg = q + g0 * h_dim;
    float* sg = scores + g0 * stride;
    switch (std::min(4, g_dim - g0)) {
      case 1: Scores<1>(qg, h_dim, k, s_dim, begin, end, sg, stride); break;
      case 2: Scores<2>(qg, h_dim, k, s_dim, begin, end, sg, stride); break;
      case 3: Scores<3>(qg, h_dim, k, s_dim, begin, end, sg, stride); break;
      default: Scores<4>(qg, h_dim, k, s_dim, begin, end, sg, stride); break;
    }
  }
}

// out[g, :] = sum over the slots s in [begin, end) with ok[s], in order, of
// p[g, s] * v[s, :], for G <= 4 heads and NV vectors of the head dimension from column c.
template <int G, int NV>
void Mix(const float* p, int64_t stride, const bool* ok, int64_t begin, int64_t end,
         const float* v, int64_t h_dim, int64_t c, float* out) {
  Vec acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = Vec{};
  for (int64_t s = begin; s < end; ++s) {
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
void MixColumns(const float* p, int64_t stride, const bool* ok, int64_t begin, int64_t end,
                const float* v, int64_t h_dim, float* out) {
  for (int64_t c = 0; c < h_dim;) {
    int64_t left = (h_dim - c) / kLanes;
    if (kMaxVectors >= 4 && left >= 4) {
      Mix<G, (kMaxVectors >= 4 ? 4 : 1)>(p, stride, ok, begin, end, v, h_dim, c, out);
      c += 4 * kLanes;
    } else if (kMaxVectors >= 2 && left >= 2) {
      Mix<G, (kMaxVectors >= 2 ? 2 : 1)>(p, stride, ok, begin, end, v, h_dim, c, out);
      c += 2 * kLanes;
    } else {
      Mix<G, 1>(p, stride, ok, begin, end, v, h_dim, c, out);
      c += kLanes;
    }
  }
}

void MixAnyG(int g_dim, const float* p, int64_t stride, const bool* ok, int64_t begin,
             int64_t end, const float* v, int64_t h_dim, float* out) {
  for (int g0 = 0; g0 < g_dim; g0 += 4) {
    const float* pg = p + g0 * stride;
    float* og = out + g0 * h_dim;
    switch (std::min(4, g_dim - g0)) {
      case 1: MixColumns<1>(pg, stride, ok, begin, end, v, h_dim, og); break;
      case 2: MixColumns<2>(pg, stride, ok, begin, end, v, h_dim, og); break;
      case 3: MixColumns<3>(pg, stride, ok, begin, end, v, h_dim, og); break;
      default: MixColumns<4>(pg, stride, ok, begin, end, v, h_dim, og); break;
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

// Row r, kv head c. `scratch` holds G rows of scores at stride `stride` (S rounded up to
// 16) and `row_ok` the row's ok flags, padded with false to `stride`.
void AttendHead(const Shape& d, float scale, const float* q, const float* k, const float* v,
                const bool* ok, float* out, int64_t r, int64_t c, float* scratch,
                bool* row_ok) {
  const int64_t head = r * d.kv + c;
  float* o = out + head * d.g * d.h;
  std::memcpy(row_ok, ok + r * d.s, d.s);
  int64_t first = 0, last = d.s - 1;
  while (first < d.s && !row_ok[first]) ++first;
  while (last > first && !row_ok[last]) --last;
  if (first == d.s) {  // nothing to attend to: 0 (an engine slot that does not decode
    std::fill(o, o + d.g * d.h, 0.0f);  // this step is masked out; its output is dropped)
    return;
  }
  // The 16-slot chunks from the first slot with ok to the last: the lane of slot s is
  // s mod 16 whatever the chunks, so the sums do not depend on the cache's width.
  const int64_t stride = (d.s + kLanes - 1) / kLanes * kLanes;
  const int64_t begin = first / kLanes * kLanes;
  const int64_t end = (last + kLanes) / kLanes * kLanes;
  ScoresAnyG(static_cast<int>(d.g), q + head * d.g * d.h, d.h, k + head * d.h * d.s, d.s, begin,
             end, scratch, stride);
  const Vec lowest = Splat(-3.402823466e38f);
  for (int64_t g = 0; g < d.g; ++g) {
    float* sg = scratch + g * stride;
    Vec top = lowest;
    for (int64_t s = begin; s < end; s += kLanes) {
      Vec x = Load(sg + s) * scale;
      x = OkMask(row_ok + s) ? x : lowest;
      Store(sg + s, x);
      top = x > top ? x : top;
    }
    const float max = LaneMax(top);
    Vec total{};
    for (int64_t s = begin; s < end; s += kLanes) {
      Vec e = ExpNonPositive(Load(sg + s) - max);
      e = OkMask(row_ok + s) ? e : Vec{};
      Store(sg + s, e);
      total += e;
    }
    const Vec sum = Splat(LaneSum(total));
    for (int64_t s = begin; s < end; s += kLanes) Store(sg + s, Load(sg + s) / sum);
  }
  MixAnyG(static_cast<int>(d.g), scratch, stride, row_ok, begin, end, v + head * d.s * d.h,
          d.h, o);
}

// Writes row r's new key and value of kv head c into its cache slot slot[r] (none if the
// slot is outside [0, S)): k's column (one float per cache line of the head-major layout)
// and v's row.
void WriteHead(const Shape& d, const float* k_new, const float* v_new, const int32_t* slot,
               float* k, float* v, int64_t r, int64_t c) {
  const int64_t s = slot[r];
  if (s < 0 || s >= d.s) return;
  const int64_t head = r * d.kv + c;
  for (int64_t h = 0; h < d.h; ++h) k[(head * d.h + h) * d.s + s] = k_new[head * d.h + h];
  std::memcpy(v + (head * d.s + s) * d.h, v_new + head * d.h, d.h * sizeof(float));
}

// (row, kv head) pairs are claimed from a shared counter by the calling thread and by
// helpers on XLA's intra-op pool, as in block_matmul.cc. With `slot` set, each pair first
// writes its new key and value into the cache (k, v) and then attends over it.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  Shape d;
  float scale;
  const float *q, *k_new = nullptr, *v_new = nullptr;
  float *k, *v;
  const int32_t* slot = nullptr;
  const bool* ok;
  float* out;
  void Run() {
    const int64_t stride = (d.s + kLanes - 1) / kLanes * kLanes;
    std::vector<float> scratch(d.g * stride);
    std::unique_ptr<bool[]> row_ok(new bool[stride]());  // past S: false, never written
    const int64_t heads = d.rows * d.kv;
    for (;;) {
      int64_t i = next.fetch_add(1);
      if (i >= heads) return;
      if (slot) WriteHead(d, k_new, v_new, slot, k, v, i / d.kv, i % d.kv);
      AttendHead(d, scale, q, k, v, ok, out, i / d.kv, i % d.kv, scratch.data(),
                 row_ok.get());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void RunOnPool(ffi::ThreadPool& pool, std::shared_ptr<Work> work) {
  const int64_t heads = work->d.rows * work->d.kv;
  int64_t threads = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), heads);
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < heads) std::this_thread::yield();
}

bool ShapesOk(ffi::Span<const int64_t> qd, ffi::Span<const int64_t> kd,
              ffi::Span<const int64_t> vd, ffi::Span<const int64_t> od) {
  return qd.size() == 4 && kd.size() == 4 && vd.size() == 4 && od.size() == 2 &&
         kd[0] == qd[0] && kd[1] == qd[1] && kd[2] == qd[3] && vd[0] == qd[0] &&
         vd[1] == qd[1] && vd[2] == kd[3] && vd[3] == qd[3] && od[0] == qd[0] &&
         od[1] == kd[3] && qd[3] % kLanes == 0;
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                           ffi::Buffer<ffi::PRED> ok, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  auto qd = q.dimensions(), kd = k.dimensions();
  if (!ShapesOk(qd, kd, v.dimensions(), ok.dimensions()))
    return ffi::Error::InvalidArgument(
        "decode_attention: q [R, K, G, H], k [R, K, H, S], v [R, K, S, H], ok [R, S] "
        "(H a multiple of 16)");
  auto work = std::make_shared<Work>();
  work->d = Shape{qd[0], qd[1], qd[2], qd[3], kd[3]};
  work->scale = scale;
  work->q = q.typed_data();
  // Only read: the pointers are non-const for the writing variant below.
  work->k = const_cast<float*>(k.typed_data());
  work->v = const_cast<float*>(v.typed_data());
  work->ok = ok.typed_data(); work->out = out->typed_data();
  RunOnPool(pool, work);
  return ffi::Error::Success();
}

// The same after writing each row's new key and value into slot[r] of its cache: k_out and
// v_out are k and v updated (the Python side aliases them to k and v, so the cache is
// updated in place; were a copy made instead, the inputs are copied over first).
ffi::Error DecodeAttentionWrite(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                                ffi::Buffer<ffi::PRED> ok, ffi::Buffer<ffi::F32> k_new,
                                ffi::Buffer<ffi::F32> v_new, ffi::Buffer<ffi::S32> slot,
                                ffi::ResultBuffer<ffi::F32> out,
                                ffi::ResultBuffer<ffi::F32> k_out,
                                ffi::ResultBuffer<ffi::F32> v_out, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), nd = k_new.dimensions(),
       wd = v_new.dimensions(), sd = slot.dimensions();
  if (!ShapesOk(qd, kd, v.dimensions(), ok.dimensions()) || nd.size() != 3 ||
      nd[0] != qd[0] || nd[1] != qd[1] || nd[2] != qd[3] || wd.size() != 3 ||
      wd[0] != nd[0] || wd[1] != nd[1] || wd[2] != nd[2] || sd.size() != 1 || sd[0] != qd[0])
    return ffi::Error::InvalidArgument(
        "decode_attention_write: q [R, K, G, H], k [R, K, H, S], v [R, K, S, H], ok [R, S], "
        "k_new and v_new [R, K, H], slot [R] (H a multiple of 16)");
  float* kc = k_out->typed_data();
  float* vc = v_out->typed_data();
  if (kc != k.typed_data()) std::memcpy(kc, k.typed_data(), k.size_bytes());
  if (vc != v.typed_data()) std::memcpy(vc, v.typed_data(), v.size_bytes());
  auto work = std::make_shared<Work>();
  work->d = Shape{qd[0], qd[1], qd[2], qd[3], kd[3]};
  work->scale = scale;
  work->q = q.typed_data(); work->k = kc; work->v = vc;
  work->k_new = k_new.typed_data(); work->v_new = v_new.typed_data();
  work->slot = slot.typed_data();
  work->ok = ok.typed_data(); work->out = out->typed_data();
  RunOnPool(pool, work);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlhfDecodeAttentionWrite, DecodeAttentionWrite,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

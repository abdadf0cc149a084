// x [M, K] times weights stored as column blocks w [P, K, B] (block p holds columns
// p*B .. p*B + B - 1 of the [K, P*B] matrix): out [M, P, B]. A decode step on CPU multiplies
// a few rows by every weight of the model, so the weights stream from memory once a step;
// this kernel reads each contiguous block once from memory and re-reads it from cache for
// every tile of rows, with the rows' partial sums in registers, where XLA:CPU's own dot
// falls well short of its in-cache rate (benchmarks/RESULTS.md, "A CPU kernel for the
// decode's weight matmuls").
//
// Numerics: every output element is the sum over k = 0 .. K-1, in that order, of
// x[m, k] * w[k, n] (one fused multiply-add per term where the target has FMA, which
// -ffp-contract=fast lets the compiler use; a multiply and an add where it has not),
// whatever M is and whichever rows share a tile, so a row's result never depends on the
// other rows.
//
// Built on first use by jaxrlhf/kernels/build.py (c++ -O3 -march=native); registered with
// XLA as the FFI target "jaxrlhf_block_matmul" by jaxrlhf/kernels/block_matmul.py.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16, kMaxVectors = 4;  // 32 vector registers
#elif defined(__AVX__)
constexpr int kLanes = 8, kMaxVectors = 2;   // 16 vector registers
#elif defined(__SSE2__)
constexpr int kLanes = 4, kMaxVectors = 2;   // 16 vector registers
#else
constexpr int kLanes = 4, kMaxVectors = 4;   // e.g. NEON: 32 vector registers
#endif
constexpr int kMaxRows = 6;

typedef float Vec __attribute__((vector_size(kLanes * 4), aligned(4)));

inline Vec Load(const float* p) { Vec v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof(v)); }

// Prefetch: `lines` cache lines from `pf` into L2, spread evenly over the k iterations.
struct Prefetch {
  const char* at = nullptr;
  int64_t lines = 0;
};

// rows x (NV * kLanes) outputs of one block: x rows at stride k, w at stride b, out at
// stride n; meanwhile `pf`'s lines are prefetched.
template <int Rows, int NV>
void Tile(const float* x, int64_t k, const float* w, int64_t b, float* out, int64_t n,
          Prefetch pf) {
  Vec acc[Rows][NV];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = Vec{};
  int64_t credit = 0;
  for (int64_t i = 0; i < k; ++i) {
    for (credit += pf.lines; credit >= k; credit -= k, pf.at += 64)
      __builtin_prefetch(pf.at, 0, 2);
    Vec wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Load(w + i * b + j * kLanes);
    for (int r = 0; r < Rows; ++r) {
      Vec xv = Vec{} + x[r * k + i];
      for (int j = 0; j < NV; ++j) acc[r][j] += xv * wv[j];  // one FMA (-ffp-contract=fast)
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < NV; ++j) Store(out + r * n + j * kLanes, acc[r][j]);
}

template <int NV>
void TileRows(int rows, const float* x, int64_t k, const float* w, int64_t b, float* out,
              int64_t n, Prefetch pf) {
  switch (rows) {
    case 1: Tile<1, NV>(x, k, w, b, out, n, pf); break;
    case 2: Tile<2, NV>(x, k, w, b, out, n, pf); break;
    case 3: Tile<3, NV>(x, k, w, b, out, n, pf); break;
    case 4: Tile<4, NV>(x, k, w, b, out, n, pf); break;
    case 5: Tile<5, NV>(x, k, w, b, out, n, pf); break;
    default: Tile<6, NV>(x, k, w, b, out, n, pf); break;
  }
}

// All m rows against one block (b columns). The rows go in tiles of at most kMaxRows, as
// even as they split, so the block is read from memory once and from cache by the others.
// Meanwhile `next` (the thread's next block, if any) is prefetched: spread over every tile
// if this block is `warm` (prefetched itself, so no tile waits for memory), else over the
// tiles after the first, which streams this block from memory.
void Block(int64_t m, const float* x, int64_t k, const float* w, int64_t b, float* out,
           int64_t n, const float* next, bool warm) {
  const int64_t tiles = (m + kMaxRows - 1) / kMaxRows;
  const int64_t next_lines = next ? k * b * 4 / 64 : 0;
  int64_t fetched = 0;
  for (int64_t c = 0; c < b;) {
    int nv = static_cast<int>(std::min<int64_t>(kMaxVectors, (b - c) / kLanes));
    int64_t r = 0;
    for (int64_t t = 0; t < tiles; ++t) {
      int64_t left = m - r, rows = (left + (tiles - t) - 1) / (tiles - t);
      const float* xr = x + r * k;
      float* o = out + r * n + c;
      Prefetch pf;
      if (next && (t > 0 || tiles == 1 || warm) && fetched < next_lines) {
        int64_t later = tiles == 1 || warm ? tiles : tiles - 1;
        int64_t share = (next_lines + later - 1) / later;
        pf.at = reinterpret_cast<const char*>(next) + fetched * 64;
        pf.lines = std::min(share, next_lines - fetched);
        fetched += pf.lines;
      }
      if (nv >= 4) TileRows<(kMaxVectors >= 4 ? 4 : 1)>(rows, xr, k, w + c, b, o, n, pf);
      else if (nv >= 2) TileRows<2>(rows, xr, k, w + c, b, o, n, pf);
      else TileRows<1>(rows, xr, k, w + c, b, o, n, pf);
      r += rows;
    }
    c += (nv >= 4 ? 4 : nv >= 2 ? 2 : 1) * kLanes;
  }
}

// Blocks are claimed from a shared counter, a chunk of them at a time, by the calling
// thread and by helpers on XLA's intra-op pool; the caller waits only for blocks a running
// thread has claimed, so a helper the pool never gets to costs nothing and cannot deadlock
// the call. While at least a chunk per thread is left unclaimed, a thread claims its next
// chunk as it starts the last block of the current one, so that it knows, and prefetches,
// the block after; near the end it claims only once it is done (no thread holds a chunk it
// has not started while another has nothing left to do).
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t blocks, chunk, threads, m, k, b, n;
  const float* x;
  const float* w;
  float* out;
  void Run() {
    int64_t first = next.fetch_add(chunk);
    bool warm = false;  // whether this block was prefetched (a thread's first is not)
    while (first < blocks) {
      int64_t last = std::min(blocks, first + chunk), following = -1;
      for (int64_t p = first; p < last; ++p) {
        if (p + 1 == last &&
            blocks - next.load(std::memory_order_relaxed) >= chunk * threads)
          following = next.fetch_add(chunk);
        int64_t after = p + 1 < last ? p + 1 : following;
        const float* prefetch = after >= 0 && after < blocks ? w + after * k * b : nullptr;
        Block(m, x, k, w + p * k * b, b, out + p * b, n, prefetch, warm);
        warm = prefetch != nullptr;
      }
      done.fetch_add(last - first, std::memory_order_release);
      first = following >= 0 ? following : next.fetch_add(chunk);
    }
  }
};

ffi::Error BlockMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> out) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1] || wd[2] % kLanes)
    return ffi::Error::InvalidArgument("block_matmul: x [M, K] and w [P, K, B] (B % lanes == 0)");
  auto work = std::make_shared<Work>();
  work->m = xd[0]; work->k = xd[1]; work->blocks = wd[0]; work->b = wd[2];
  work->n = wd[0] * wd[2];
  work->x = x.typed_data(); work->w = w.typed_data(); work->out = out->typed_data();
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->threads = threads;
  work->chunk = std::max<int64_t>(1, work->blocks / (4 * threads));
  for (int64_t t = 1; t < threads; ++t) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->blocks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlhfBlockMatmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

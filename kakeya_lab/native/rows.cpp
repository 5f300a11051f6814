// out[r, j] = sum_k rows[r, k] * weight[j, k] for a few rows (1 to 16), float32, in the
// vectors of simd.h (AVX-512's 16 lanes, or AVX2's 8).
//
// Each weight row is read once for all the input rows: R weight rows at a time are
// multiplied by every input row (up to 8 at a time with AVX-512's 32 registers, 4 with AVX2's
// 16), a vector of inputs per step, into R x N vector accumulators, then each accumulator is
// summed. The output rows are split over PyTorch's threads
// (at::parallel_for), so a one-token step streams the weights on every core, and a block of a
// few tokens costs little more than one. Built with step.cpp by kakeya_lab/native/build.py.
//
// One or two input rows are memory-bound: there a thread reads its weight rows one after the
// other (R = 1), a single stream the hardware prefetcher follows at the memory's full speed.
// R weight rows at a time are R streams; on a Zen 4 whose memory read 64 GB/s, the 121
// products of the default model's one-token step took 1.27x a plain read of their bytes that
// way, and 1.10x as one stream. With more input rows the multiplications take as long as the
// reads, and R weight rows share each input load; the weight rows of the block after next are
// prefetched into L2 while a block computes, since the hardware prefetcher then falls behind
// (8 rows cost 1.6x as much without it). Every R sums each output in the same order, so a
// row's output does not depend on how many rows came with it.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "kernels.h"
#include "simd.h"

namespace {

using simd::LANES;
using simd::vec;

constexpr int64_t AHEAD = 2;  // blocks prefetched ahead; 1 to 8 measured the same, 0 slower

// y[r, j + a] for R weight rows j.. and N input rows, N x R accumulators in registers;
// ``next``: the weight rows to prefetch into L2 meanwhile (nullptr: none)
template <int N, int R>
inline void block_product(const float* x, const float* w, float* y, int64_t in, int64_t out,
                          int64_t j, const float* next) {
  vec acc[R][N];
  for (int a = 0; a < R; ++a)
    for (int r = 0; r < N; ++r) acc[a][r] = simd::zero();
  for (int64_t k = 0; k < in; k += LANES) {
    vec wv[R];  // the weights in registers, each input row loaded as it is used
    for (int a = 0; a < R; ++a) wv[a] = simd::load(w + (j + a) * in + k);
    if (next != nullptr && (LANES == 16 || k % 16 == 0))  // a cache line of each
      for (int a = 0; a < R; ++a)
        _mm_prefetch(reinterpret_cast<const char*>(next + a * in + k), _MM_HINT_T1);
    for (int r = 0; r < N; ++r) {
      const vec xv = simd::load(x + r * in + k);
      for (int a = 0; a < R; ++a) acc[a][r] = simd::fmadd(wv[a], xv, acc[a][r]);
    }
  }
  for (int a = 0; a < R; ++a)
    for (int r = 0; r < N; ++r) y[r * out + j + a] = simd::sum(acc[a][r]);
}

// input rows at a time: as many as keep R x CHUNK accumulators in the registers
constexpr int CHUNK = simd::REGISTERS == 32 ? 8 : 4;

// block j's outputs for N input rows, CHUNK input rows at a time over the block of weight
// rows while it is still in L1
template <int N, int R>
inline void chunks(const float* x, const float* w, float* y, int64_t in, int64_t out,
                   int64_t j, const float* next) {
  block_product<(N <= CHUNK ? N : CHUNK), R>(x, w, y, in, out, j, next);
  if constexpr (N > CHUNK)
    chunks<N - CHUNK, R>(x + CHUNK * in, w, y + CHUNK * out, in, out, j, nullptr);
}

// the output rows j0..j1 of N input rows: R weight rows at a time
template <int N, int R>
void rows_block(const float* x, const float* w, float* y, int64_t in, int64_t out,
                int64_t j0, int64_t j1) {
  int64_t j = j0;
  for (; j + R <= j1; j += R) {
    // a hint (no fault past the end); one stream needs none
    const float* next = R == 1 ? nullptr : w + (j + AHEAD * R) * in;
    chunks<N, R>(x, w, y, in, out, j, next);
  }
  for (; j < j1; ++j) chunks<N, 1>(x, w, y, in, out, j, nullptr);  // the rest, one at a time
}

template <int N>
void rows_run(const float* x, const float* w, float* y, int64_t in, int64_t out) {
  // R x min(N, CHUNK) accumulators within the vector registers
  constexpr int R = N <= 2 ? 1 : (N <= 4 && CHUNK == 8 ? 4 : 2);
  at::parallel_for(0, out, 64, [&](int64_t j0, int64_t j1) {
    rows_block<N, R>(x, w, y, in, out, j0, j1);
  });
}

using Run = void (*)(const float*, const float*, float*, int64_t, int64_t);
const Run RUNS[] = {rows_run<1>,  rows_run<2>,  rows_run<3>,  rows_run<4>,
                    rows_run<5>,  rows_run<6>,  rows_run<7>,  rows_run<8>,
                    rows_run<9>,  rows_run<10>, rows_run<11>, rows_run<12>,
                    rows_run<13>, rows_run<14>, rows_run<15>, rows_run<16>};
constexpr int64_t MAX_ROWS = sizeof(RUNS) / sizeof(RUNS[0]);

}  // namespace

torch::Tensor rows_product(torch::Tensor rows, torch::Tensor weight) {
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 2, "rows_product takes 2-D rows and weight");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kFloat,
              "rows_product takes float32");
  TORCH_CHECK(rows.is_contiguous() && weight.is_contiguous(), "rows_product takes contiguous");
  const int64_t n = rows.size(0), in = rows.size(1), out = weight.size(0);
  TORCH_CHECK(weight.size(1) == in && in % 16 == 0, "rows_product: input width a multiple of 16");
  TORCH_CHECK(1 <= n && n <= MAX_ROWS, "rows_product takes 1 to ", MAX_ROWS, " rows");
  auto y = torch::empty({n, out}, rows.options());
  RUNS[n - 1](rows.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), in, out);
  return y;
}

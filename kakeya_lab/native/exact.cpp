// out[r, j] = sum_k rows[r, k] * weight[j, k] for 1 to 16 float32 rows, the float32 weight
// read from its exact integer form: the same numbers as rows.cpp's product, from a sixth (4-bit
// form) or a third (8-bit form) of the bytes.
//
// A model dequantised from a GGUF of 4- or 8-bit blocks holds float32 weights that are, per
// group of 32 inputs of a row, w = q * d + m (Q4_1: q in 0..15, d a float16 value, m a
// float32) or w = q * d (Q8_0: q in -128..127, d a float16 value); kakeya_lab/native/exact.py
// finds q, d (and m) and keeps them only when they give back every weight exactly. q * d has
// at most 19 significant bits, so it is exact in float32, and the 4-bit form's w rounds once,
// in the add, the same whether the multiply and the add are fused or not. Each weight row's
// vectors are therefore rows.cpp's, and each output is summed as rows.cpp sums it (a vector's
// lanes, input order, one fused multiply-add per vector, then the lanes), bit for bit.
//
// Layout, by the codes' dtype. 4-bit: codes [out, in / 2] uint8, per group 16 bytes, byte b
// holding q of input b (low nibble) and of input b + 16 (high nibble); so [out, in / 32, 2]
// float32, each group's d and m. 8-bit: codes [out, in] int8; so [out, in / 32, 1], each
// group's d. The unpacking is what a one-token step's time goes to: two weight rows at a time
// (one accumulator chain each, so the fused multiply-adds overlap), each group unpacked once
// for up to 8 input rows (with AVX2's 16 registers: 4, or 8 one weight row at a time), the
// output rows split over PyTorch's threads. With AVX-512 a group's 16 weight values are a
// table its codes index; AVX2 has no 16-entry lookup, and converts each code (q * d + m, the
// same fused operation).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using simd::LANES;
using simd::vec;

constexpr int64_t GROUP = 32;
// weight-row blocks prefetched ahead: with the hardware prefetcher alone the default model's
// products took about a sixth longer for one row and a quarter longer for 8 (its output layer's,
// nearly twice as long); 4 to 32 blocks measured alike
constexpr int64_t AHEAD = 4;

// the vectors of a group (32 inputs) that one unpacking gives: AVX-512's two (the whole
// group), or AVX2's two of four (inputs 16 h .. 16 h + 15: the low nibbles, then the high)
constexpr int PARTS = GROUP / (2 * LANES);

// part h of group g of weight row j: its two weight vectors
template <bool FOUR>
inline void weights(const void* codes, const float* so, int64_t in, int64_t j, int64_t g,
                    int h, vec& w0, vec& w1) {
  const int64_t groups = in / GROUP;
#if defined(__AVX512F__)
  (void)h;  // PARTS == 1
  if constexpr (FOUR) {
    const auto* c = static_cast<const uint8_t*>(codes) + j * (in / 2) + 16 * g;
    const float* p = so + (j * groups + g) * 2;
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    // the group's 16 possible weights, q * d + m for q = 0..15 (fused: q * d is exact, so
    // the one rounding is the dequantiser's), looked up by each lane's nibble (a lookup
    // measured faster than converting and scaling every lane)
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(levels, _mm512_set1_ps(p[0]), _mm512_set1_ps(p[1]));
    w0 = _mm512_permutexvar_ps(bytes, table);  // the index's low 4 bits: the low nibble
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
  } else {
    const auto* c = static_cast<const int8_t*>(codes) + j * in + GROUP * g;
    const __m512 d = _mm512_set1_ps(so[j * groups + g]);
    const __m512i lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    const __m512i hi =
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + 16)));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(hi), d);
  }
#else
  if constexpr (FOUR) {
    const auto* c = static_cast<const uint8_t*>(codes) + j * (in / 2) + 16 * g;
    const float* p = so + (j * groups + g) * 2;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    const __m128i q = _mm_and_si128(h == 0 ? bytes : _mm_srli_epi16(bytes, 4), _mm_set1_epi8(15));
    const __m256 d = _mm256_set1_ps(p[0]), m = _mm256_set1_ps(p[1]);
    w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), d, m);
    w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))), d, m);
  } else {
    const auto* c = static_cast<const int8_t*>(codes) + j * in + GROUP * g + 16 * h;
    const __m256 d = _mm256_set1_ps(so[j * groups + g]);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), d);
  }
#endif
}

// y[r, j + a] for R weight rows j.. and N input rows
template <bool FOUR, int N, int R>
inline void block_product(const float* x, const void* codes, const float* so, float* y,
                          int64_t in, int64_t out, int64_t j) {
  vec acc[R][N];
  for (int a = 0; a < R; ++a)
    for (int r = 0; r < N; ++r) acc[a][r] = simd::zero();
  for (int64_t g = 0; g < in / GROUP; ++g) {
    for (int h = 0; h < PARTS; ++h) {
      vec w0[R], w1[R];
      for (int a = 0; a < R; ++a) weights<FOUR>(codes, so, in, j + a, g, h, w0[a], w1[a]);
      for (int r = 0; r < N; ++r) {
        const float* xg = x + r * in + GROUP * g + 2 * LANES * h;
        const vec x0 = simd::load(xg), x1 = simd::load(xg + LANES);
        for (int a = 0; a < R; ++a) acc[a][r] = simd::fmadd(w0[a], x0, acc[a][r]);
        for (int a = 0; a < R; ++a) acc[a][r] = simd::fmadd(w1[a], x1, acc[a][r]);
      }
    }
  }
  for (int a = 0; a < R; ++a)
    for (int r = 0; r < N; ++r) y[r * out + j + a] = simd::sum(acc[a][r]);
}

// input rows at a time for R weight rows: as many as keep R x CHUNK accumulators and the 2 R
// weight vectors in the registers (AVX2's 16 hold 8 rows' for one weight row, 4 for two)
template <int R>
constexpr int CHUNK = simd::REGISTERS == 32 || R == 1 ? 8 : 4;

// block j's outputs for N input rows, CHUNK input rows at a time over the block's codes
// while they are still in L1 (each pass unpacks them again)
template <bool FOUR, int N, int R>
inline void chunks(const float* x, const void* codes, const float* so, float* y, int64_t in,
                   int64_t out, int64_t j) {
  constexpr int C = CHUNK<R>;
  block_product<FOUR, (N <= C ? N : C), R>(x, codes, so, y, in, out, j);
  if constexpr (N > C) chunks<FOUR, N - C, R>(x + C * in, codes, so, y + C * out, in, out, j);
}

// y for weight rows j0..j1 and all N input rows: R weight rows at a time, each group's weights
// unpacked once for up to CHUNK input rows, the codes AHEAD blocks on prefetched meanwhile
template <bool FOUR, int N>
void rows_run(const float* x, const void* codes, const float* so, float* y, int64_t in,
              int64_t out) {
  // two weight rows at a time (two chains of dependent multiply-adds for one input row), but
  // one with AVX2 above 4 input rows: then 8 input rows share each unpacking, not 4
  constexpr int R = simd::REGISTERS == 16 && N > 4 ? 1 : 2;
  const int64_t code_bytes = FOUR ? in / 2 : in, so_bytes = (in / GROUP) * (FOUR ? 2 : 1) * 4;
  at::parallel_for(0, out, 64, [&](int64_t j0, int64_t j1) {
    int64_t j = j0;
    for (; j + R <= j1; j += R) {
      if (j + (AHEAD + 1) * R <= j1) {  // a hint: no fault past the end, but no use either
        const char* c = static_cast<const char*>(codes) + (j + AHEAD * R) * code_bytes;
        const char* s = reinterpret_cast<const char*>(so) + (j + AHEAD * R) * so_bytes;
        for (int64_t b = 0; b < R * code_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
        for (int64_t b = 0; b < R * so_bytes; b += 64) _mm_prefetch(s + b, _MM_HINT_T0);
      }
      chunks<FOUR, N, R>(x, codes, so, y, in, out, j);
    }
    for (; j < j1; ++j) chunks<FOUR, N, 1>(x, codes, so, y, in, out, j);
  });
}

using Run = void (*)(const float*, const void*, const float*, float*, int64_t, int64_t);
template <bool FOUR>
constexpr Run RUNS[] = {
    rows_run<FOUR, 1>,  rows_run<FOUR, 2>,  rows_run<FOUR, 3>,  rows_run<FOUR, 4>,
    rows_run<FOUR, 5>,  rows_run<FOUR, 6>,  rows_run<FOUR, 7>,  rows_run<FOUR, 8>,
    rows_run<FOUR, 9>,  rows_run<FOUR, 10>, rows_run<FOUR, 11>, rows_run<FOUR, 12>,
    rows_run<FOUR, 13>, rows_run<FOUR, 14>, rows_run<FOUR, 15>, rows_run<FOUR, 16>};
constexpr int64_t MAX_ROWS = 16;

}  // namespace

torch::Tensor exact_product(const torch::Tensor& rows, const torch::Tensor& codes,
                            const torch::Tensor& so) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat && rows.is_contiguous(),
              "exact_product takes contiguous 2-D float32 rows");
  const int64_t n = rows.size(0), in = rows.size(1);
  const bool four = codes.scalar_type() == torch::kUInt8;
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() && in % GROUP == 0 &&
                  (four || codes.scalar_type() == torch::kChar) &&
                  codes.size(1) == (four ? in / 2 : in),
              "exact_product: codes [out, in / 2] uint8 (4-bit) or [out, in] int8 (8-bit) "
              "for rows of ", in, " inputs");
  const int64_t out = codes.size(0);
  TORCH_CHECK(so.scalar_type() == torch::kFloat && so.is_contiguous() &&
                  so.numel() == out * (in / GROUP) * (four ? 2 : 1),
              "exact_product: so [out, in / 32, ", four ? 2 : 1, "] float32");
  TORCH_CHECK(1 <= n && n <= MAX_ROWS, "exact_product takes 1 to ", MAX_ROWS, " rows");
  auto y = torch::empty({n, out}, rows.options());
  const Run run = four ? RUNS<true>[n - 1] : RUNS<false>[n - 1];
  run(rows.data_ptr<float>(), codes.data_ptr(), so.data_ptr<float>(), y.data_ptr<float>(), in,
      out);
  return y;
}

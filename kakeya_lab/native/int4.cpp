// out[r, j] = sum_k rows[r, k] * w[j, k] for a few float32 rows and int4 weights, on integer
// dot products (AVX-512 VNNI).
//
// The weights are kakeya_lab.linear's int4: per output row, groups of 32 inputs, each a 4-bit
// q in 0..15, a bfloat16 scale s and offset o, w = (q - 8) * s + o. Each input row is written
// per group of 32 in two int8 parts, x ~ sx * (xq + xr / 254) with sx = max |x| / 127 (xq the
// row rounded, xr its rounding error rounded in turn: about 15 bits, finer than bfloat16's 8),
// so one group's sum is
//     sum_k w_k x_k ~ s * (sx * (sum q xq + sum q xr / 254) - 8 * sum x) + o * sum x
// (sum x exact) and both sums over q are integer dot products: VPDPBUSD multiplies 64 unsigned
// by 64 signed bytes into 16 int32 sums. Sixteen output rows are one vector's lanes: the
// packed weights give each lane four consecutive inputs in a 32-bit word, and the row's
// matching four int8 inputs are broadcast to every lane. A one-token step reads 4.5 bits a
// weight (4 of q, 0.5 of the scales) and its integer products cost less than the reads;
// PyTorch's int4 kernel converts every weight to bfloat16 first and is bound by that.
//
// Layout (kakeya_lab/native/int4.py packs it): the output rows in tiles of 64 (4 blocks of
// 16), each tile one stream:
//   packed [out / 64][in / 8][4][16][4] uint8: byte j of lane i of block b holds q of output
//       64 t + 16 b + i at inputs 8 s + j (low nibble) and 8 s + 4 + j (high nibble);
//   scales [out / 64][in / 32][4][2][16] bfloat16: each block's 16 scales, then 16 offsets.
// Built with the other kernels by kakeya_lab/native/build.py; only called on CPUs with
// AVX-512 BW and VNNI (the functions below are compiled for them alone).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t GROUP = 32;  // inputs per scale and offset
constexpr int64_t TILE = 4;    // blocks of 16 output rows per tile

#define VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni,fma")))

// One input row in two int8 parts per group of 32: x ~ sx * (xq + xr / 254), xq the row
// rounded to int8 and xr its rounding error (at most half a step) rounded to int8 in turn;
// each group's sx and exact sum. xq fills the first in bytes, xr the next in.
VNNI void quantise_row(const float* x, int64_t in, int8_t* xq, float* sx, float* sum) {
  const __m512 fine = _mm512_set1_ps(2.f * 127.f);
  for (int64_t g = 0; g < in / GROUP; ++g) {
    const __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    for (int h = 0; h < 2; ++h) {
      // round to nearest even (the default mode); |x * inv| <= 127 and |error| <= 0.5
      const __m512 scaled = _mm512_mul_ps(h ? b : a, inv);
      const __m512i q = _mm512_cvtps_epi32(scaled);
      const __m512 error = _mm512_sub_ps(scaled, _mm512_cvtepi32_ps(q));
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(error, fine));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + g * GROUP + 16 * h),
                       _mm512_cvtsepi32_epi8(q));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + in + g * GROUP + 16 * h),
                       _mm512_cvtsepi32_epi8(r));
    }
    sx[g] = top / 127.f;
    sum[g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
}

VNNI inline __m512 load_bf16(const uint16_t* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i wide = _mm512_cvtepu16_epi32(half);
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Four int8 inputs as one 32-bit word, to broadcast to every lane.
inline int32_t quad(const int8_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return word;
}

// Tiles t0..t1 (64 output rows each) for one rounded input row.
VNNI void tiles(const uint8_t* packed, const uint16_t* scales, const int8_t* xq,
                const float* sx, const float* sum, float* y, int64_t in, int64_t t0,
                int64_t t1) {
  const int64_t groups = in / GROUP;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const int8_t* fine = xq + in;  // xr follows xq
  for (int64_t t = t0; t < t1; ++t) {
    const uint8_t* w = packed + t * (in / 8) * TILE * 64;
    const uint16_t* so = scales + t * groups * TILE * 32;
    __m512 acc[TILE];
    for (int b = 0; b < TILE; ++b) acc[b] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512i dot[TILE], fine_dot[TILE];
      for (int b = 0; b < TILE; ++b) dot[b] = fine_dot[b] = _mm512_setzero_si512();
      for (int64_t s = 0; s < GROUP / 8; ++s) {
        const int64_t step = g * (GROUP / 8) + s;
        const __m512i lo_x = _mm512_set1_epi32(quad(xq + 8 * step));
        const __m512i hi_x = _mm512_set1_epi32(quad(xq + 8 * step + 4));
        const __m512i lo_r = _mm512_set1_epi32(quad(fine + 8 * step));
        const __m512i hi_r = _mm512_set1_epi32(quad(fine + 8 * step + 4));
        for (int b = 0; b < TILE; ++b) {
          const __m512i v = _mm512_loadu_si512(w + (step * TILE + b) * 64);
          const __m512i lo = _mm512_and_si512(v, nibble);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          dot[b] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[b], lo, lo_x), hi, hi_x);
          fine_dot[b] =
              _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(fine_dot[b], lo, lo_r), hi, hi_r);
        }
      }
      const __m512 scale_x = _mm512_set1_ps(sx[g]), total = _mm512_set1_ps(sum[g]);
      const __m512 scale_r = _mm512_set1_ps(sx[g] / (2.f * 127.f));
      const __m512 eight_total = _mm512_set1_ps(8.f * sum[g]);
      for (int b = 0; b < TILE; ++b) {
        const uint16_t* p = so + (g * TILE + b) * 32;
        const __m512 coarse = _mm512_fmsub_ps(_mm512_cvtepi32_ps(dot[b]), scale_x, eight_total);
        const __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(fine_dot[b]), scale_r, coarse);
        acc[b] = _mm512_fmadd_ps(load_bf16(p), d, acc[b]);
        acc[b] = _mm512_fmadd_ps(load_bf16(p + 16), total, acc[b]);
      }
    }
    for (int b = 0; b < TILE; ++b) _mm512_storeu_ps(y + t * TILE * 16 + b * 16, acc[b]);
  }
}

}  // namespace

torch::Tensor int4_product(const torch::Tensor& rows, const torch::Tensor& packed,
                           const torch::Tensor& scales) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"),
              "int4_product needs a CPU with AVX-512 BW and VNNI");
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == torch::kFloat && rows.is_contiguous(),
              "int4_product takes contiguous 2-D float32 rows");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kUInt8 &&
                  packed.is_contiguous() && packed.size(2) == TILE && packed.size(3) == 16 &&
                  packed.size(4) == 4,
              "int4_product: packed weights as kakeya_lab/native/int4.py packs them");
  const int64_t n = rows.size(0), in = rows.size(1), tiles_n = packed.size(0);
  const int64_t out = tiles_n * TILE * 16;
  TORCH_CHECK(in % GROUP == 0 && packed.size(1) == in / 8,
              "int4_product: rows of ", packed.size(1) * 8, " inputs, got ", in);
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == tiles_n * (in / GROUP) * TILE * 32,
              "int4_product: scales as kakeya_lab/native/int4.py packs them");
  auto y = torch::empty({n, out}, rows.options());
  std::vector<int8_t> xq(2 * n * in);
  std::vector<float> sx(n * (in / GROUP)), sum(n * (in / GROUP));
  for (int64_t r = 0; r < n; ++r)
    quantise_row(rows.data_ptr<float>() + r * in, in, xq.data() + 2 * r * in,
                 sx.data() + r * (in / GROUP), sum.data() + r * (in / GROUP));
  const auto* w = packed.data_ptr<uint8_t>();
  const auto* so = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  float* out_ptr = y.data_ptr<float>();
  at::parallel_for(0, tiles_n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t r = 0; r < n; ++r)
      tiles(w, so, xq.data() + 2 * r * in, sx.data() + r * (in / GROUP),
            sum.data() + r * (in / GROUP), out_ptr + r * out, in, t0, t1);
  });
  return y;
}

// One decoder layer of a few float32 rows over one cache, every projection an int4 product
// (weights: the packed q/k/v, output, gate/up and down projections, each (packed, scales) as
// int4.py packs them, no biases): layer.cpp's decoder_layer.
torch::Tensor int4_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                         const torch::Tensor& norm2, double eps,
                         const std::vector<torch::Tensor>& weights, const torch::Tensor& cos,
                         const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                         const torch::Tensor& keys, const torch::Tensor& values, int64_t start,
                         int64_t columns, const c10::optional<torch::Tensor>& mask,
                         double scale) {
  TORCH_CHECK(weights.size() == 8, "int4_layer: (packed, scales) of 4 projections");
  const Product product = [&](const torch::Tensor& rows, int i) {
    return int4_product(rows, weights[2 * i], weights[2 * i + 1]);
  };
  return decoder_layer(x, norm1, norm2, eps, product, cos, sin, heads, kv_heads, {keys},
                       {values}, {0, x.size(0)}, {start}, {columns}, {mask}, scale);
}

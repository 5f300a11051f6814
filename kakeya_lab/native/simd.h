// The float32 vector the kernels are written in, for the instruction set the build's flags
// name (kakeya_lab/native/build.py): AVX-512's 16 lanes where the CPU has AVX-512F and DQ,
// AVX2's 8 otherwise (with FMA). Each operation is one intrinsic of that set (or a few, where
// AVX2 has no single one), inlined, so a kernel written on `vec` compiles to what it would
// be written on the intrinsics directly. A sum over the lanes (`sum`) adds them in a fixed
// order for a given set, so two kernels summing the same vectors get the same bits on one
// machine; across the two sets they differ by float rounding.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace simd {

#if defined(__AVX512F__)

constexpr int64_t LANES = 16;
constexpr int REGISTERS = 32;
using vec = __m512;

inline vec zero() { return _mm512_setzero_ps(); }
inline vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec set1(float x) { return _mm512_set1_ps(x); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum(vec v) { return _mm512_reduce_add_ps(v); }
// the first n (< LANES) lanes of p, the others 0
inline vec load_first(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline void store_first(float* p, vec v, int64_t n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
// p * 2^n for integer-valued n (scalef scales by 2^floor(n), any n)
inline vec times_two_to(vec p, vec n) { return _mm512_scalef_ps(p, n); }
inline vec round_nearest(vec x) {
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// the lanes of v where a >= b, 0 elsewhere
inline vec keep_where_ge(vec v, vec a, vec b) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), v);
}
inline vec max(vec a, vec b) { return _mm512_max_ps(a, b); }

#else  // AVX2 and FMA

constexpr int64_t LANES = 8;
constexpr int REGISTERS = 16;
using vec = __m256;

inline vec zero() { return _mm256_setzero_ps(); }
inline vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec set1(float x) { return _mm256_set1_ps(x); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec sub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec mul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec fmadd(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum(vec v) {  // halves, then quarters, then the last two lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline __m256i first_lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first_lanes(n)); }
inline void store_first(float* p, vec v, int64_t n) { _mm256_maskstore_ps(p, first_lanes(n), v); }
// p * 2^n for integer-valued n in -126..127 (the exponent written directly)
inline vec times_two_to(vec p, vec n) {
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                          _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
inline vec round_nearest(vec x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline vec keep_where_ge(vec v, vec a, vec b) {
  return _mm256_and_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ), v);
}
inline vec max(vec a, vec b) { return _mm256_max_ps(a, b); }

#endif

// e^x to a few ulps: x = n ln2 + t with |t| <= ln2 / 2, e^t by its Taylor series to t^7
// (truncated: a relative error below 1e-8), times 2^n. Below -87 (where e^x is no longer a
// normal float, and for -inf: a masked column) it gives 0; the kernels call it on x <= 0.
inline vec exp(vec x) {
  const vec floor = set1(-87.0f);
  const vec live = x;
  x = max(x, floor);
  const vec n = round_nearest(mul(x, set1(1.44269504088896341f)));
  vec t = fmadd(n, set1(-0.693145751953125f), x);        // ln2, high bits
  t = fmadd(n, set1(-1.428606765330187045e-06f), t);     // and the rest
  vec p = set1(1.0f / 5040);
  p = fmadd(p, t, set1(1.0f / 720));
  p = fmadd(p, t, set1(1.0f / 120));
  p = fmadd(p, t, set1(1.0f / 24));
  p = fmadd(p, t, set1(1.0f / 6));
  p = fmadd(p, t, set1(0.5f));
  p = fmadd(p, t, set1(1.0f));
  p = fmadd(p, t, set1(1.0f));
  return keep_where_ge(times_two_to(p, n), live, floor);
}

}  // namespace simd

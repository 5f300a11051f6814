// The small operations of a decoder layer's step, each one pass in place of several PyTorch
// operations (float32, AVX-512): the RMSNorm, the rotary embedding of the q and k heads and
// the attention of a few queries over a cache's keys. In a one-token step these run between the
// weight products thirty times a token, where dispatching PyTorch's many small operations
// costs more than their arithmetic. Built with rows.cpp by kakeya_lab/native/build.py (see
// kakeya_lab/native/step.py); each checks the shapes it assumes.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

using torch::Tensor;

namespace {

void check_float(const Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu(), name,
              " must be a float32 CPU tensor");
}

}  // namespace

// x [n, width] -> x / sqrt(mean(x^2) + eps) * weight, each row on its own.
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps) {
  check_float(x, "rms_norm's rows");
  check_float(weight, "rms_norm's weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous(),
              "rms_norm takes contiguous 2-D rows");
  const int64_t n = x.size(0), width = x.size(1);
  TORCH_CHECK(weight.numel() == width && width % 16 == 0, "rms_norm: width a multiple of 16");
  auto y = torch::empty_like(x);
  const float* w = weight.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {
    const float* xr = x.data_ptr<float>() + r * width;
    float* yr = y.data_ptr<float>() + r * width;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t k = 0; k < width; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(width);
    const __m512 scale = _mm512_set1_ps(1.0f / std::sqrt(mean + static_cast<float>(eps)));
    for (int64_t k = 0; k < width; k += 16) {
      const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(xr + k), scale);
      _mm512_storeu_ps(yr + k, _mm512_mul_ps(_mm512_loadu_ps(w + k), normed));
    }
  }
  return y;
}

// rows [n, heads_total, d]: the first `heads` heads of each row rotated in place by that row's
// cos and sin [n, d] (transformers' rotate_half form: x * cos + rotate_half(x) * sin).
void rotate_(Tensor rows, const Tensor& cos, const Tensor& sin, int64_t heads) {
  check_float(rows, "rotate_'s rows");
  TORCH_CHECK(rows.dim() == 3 && rows.is_contiguous(), "rotate_ takes contiguous [n, heads, d]");
  const int64_t n = rows.size(0), total = rows.size(1), d = rows.size(2), half = d / 2;
  TORCH_CHECK(0 <= heads && heads <= total && d % 2 == 0, "rotate_: heads or head size");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == n && cos.size(1) == d &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotate_ takes contiguous cos and sin [n, d]");
  check_float(cos, "cos");
  check_float(sin, "sin");
  for (int64_t r = 0; r < n; ++r) {
    const float* c = cos.data_ptr<float>() + r * d;
    const float* s = sin.data_ptr<float>() + r * d;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = rows.data_ptr<float>() + (r * total + h) * d;
      for (int64_t k = 0; k < half; ++k) {
        const float a = v[k], b = v[k + half];
        v[k] = a * c[k] - b * s[k];
        v[k + half] = b * c[k + half] + a * s[k + half];
      }
    }
  }
}

// The attention of a few queries: q [heads, n, d] (each query's d numbers contiguous) over
// keys and values [1, kv_heads, columns, d] (each key's d numbers contiguous; the heads may be
// further apart, as in a cache's storage), the query heads grouped onto the key heads in
// order; query r does not see the columns where `mask` [n, columns] is false. Returns
// [n, heads * d].
Tensor attend(const Tensor& q, const Tensor& keys, const Tensor& values,
              const c10::optional<Tensor>& mask, double scale) {
  check_float(q, "attend's queries");
  check_float(keys, "attend's keys");
  check_float(values, "attend's values");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "attend takes queries [heads, n, d]");
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.size(0) == 1,
              "attend takes keys and values [1, kv_heads, columns, d]");
  const int64_t heads = q.size(0), n = q.size(1), d = q.size(2);
  const int64_t kv = keys.size(1), columns = keys.size(2);
  TORCH_CHECK(keys.size(3) == d && d % 16 == 0 && kv > 0 && heads % kv == 0 && columns > 0 &&
                  n > 0,
              "attend: head sizes");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == d && values.stride(3) == 1 &&
                  values.stride(2) == d,
              "attend: each key's numbers contiguous");
  const bool* seen = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() &&
                    mask->dim() == 2 && mask->size(0) == n && mask->size(1) == columns,
                "attend: a contiguous bool mask [n, columns]");
    seen = mask->data_ptr<bool>();
  }
  auto out = torch::empty({n, heads * d}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv, kstride = keys.stride(1), vstride = values.stride(1);
  const int64_t qhead = q.stride(0), qrow = q.stride(1);
  const float s = static_cast<float>(scale);
  // (head, query) pairs split over the threads (the keys come from memory), unless there is
  // next to nothing
  const int64_t pairs = heads * n;
  const int64_t grain = columns * d * pairs < (1 << 14) ? pairs : 1;
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> score(columns);
    std::vector<__m512> acc(d / 16);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t h = p / n, r = p % n;
      const float* qh = qp + h * qhead + r * qrow;
      const float* kh = kp + (h / group) * kstride;
      const float* vh = vp + (h / group) * vstride;
      const bool* row_seen = seen ? seen + r * columns : nullptr;
      float top = -INFINITY;
      for (int64_t c = 0; c < columns; ++c) {
        if (row_seen && !row_seen[c]) {
          score[c] = -INFINITY;
          continue;
        }
        __m512 dot = _mm512_setzero_ps();
        for (int64_t k = 0; k < d; k += 16)
          dot = _mm512_fmadd_ps(_mm512_loadu_ps(qh + k), _mm512_loadu_ps(kh + c * d + k), dot);
        score[c] = _mm512_reduce_add_ps(dot) * s;
        top = std::max(top, score[c]);
      }
      TORCH_CHECK(top > -INFINITY, "attend: query ", r, " sees no column");
      float total = 0.0f;
      for (int64_t c = 0; c < columns; ++c) total += score[c] = std::exp(score[c] - top);
      std::fill(acc.begin(), acc.end(), _mm512_setzero_ps());
      for (int64_t c = 0; c < columns; ++c) {
        if (score[c] == 0.0f) continue;
        const __m512 w = _mm512_set1_ps(score[c]);
        for (int64_t k = 0; k < d / 16; ++k)
          acc[k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vh + c * d + 16 * k), acc[k]);
      }
      const __m512 inv = _mm512_set1_ps(1.0f / total);
      float* o = op + r * heads * d + h * d;
      for (int64_t k = 0; k < d / 16; ++k) _mm512_storeu_ps(o + 16 * k, _mm512_mul_ps(acc[k], inv));
    }
  });
  return out;
}

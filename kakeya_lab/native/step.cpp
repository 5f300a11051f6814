// The small operations of a decoder layer's step, each one pass in place of several PyTorch
// operations (float32, in simd.h's vectors): the RMSNorm, the rotary embedding of the q and k
// heads and the attention of a few queries over a cache's keys. In a one-token step these run
// between the weight products thirty times a token, where dispatching PyTorch's many small
// operations costs more than their arithmetic. Built with rows.cpp by
// kakeya_lab/native/build.py (see kakeya_lab/native/step.py); each checks the shapes it assumes.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

using simd::LANES;
using simd::vec;
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
    vec squares = simd::zero();
    for (int64_t k = 0; k < width; k += LANES) {
      const vec v = simd::load(xr + k);
      squares = simd::fmadd(v, v, squares);
    }
    const float mean = simd::sum(squares) / static_cast<float>(width);
    const vec scale = simd::set1(1.0f / std::sqrt(mean + static_cast<float>(eps)));
    for (int64_t k = 0; k < width; k += LANES) {
      const vec normed = simd::mul(simd::load(xr + k), scale);
      simd::store(yr + k, simd::mul(simd::load(w + k), normed));
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

// a[0:LANES * VECS] = sum over c < width of w[c] * v[c * LANES * VECS ...], skipping the
// columns whose weight is 0 (masked, or too small to count: their slots may hold anything,
// even NaN). Two columns at a time into two sets of accumulators where the registers hold
// both (VECS is known), which halves the chain of dependent additions; one set otherwise.
template <int VECS>
void weigh_values_(const float* w, const float* v, int64_t width, float* a) {
  constexpr int64_t D = LANES * VECS;
  constexpr bool PAIRS = 2 * VECS + 2 <= simd::REGISTERS;
  vec even[VECS], odd[VECS];
  for (int k = 0; k < VECS; ++k) even[k] = odd[k] = simd::zero();
  const auto add = [&](vec* into, int64_t c) {
    const vec wc = simd::set1(w[c]);
    for (int k = 0; k < VECS; ++k)
      into[k] = simd::fmadd(wc, simd::load(v + c * D + LANES * k), into[k]);
  };
  int64_t c = 0;
  for (; c + 2 <= width; c += 2) {
    if (w[c] != 0.0f) add(even, c);
    if (w[c + 1] != 0.0f) add(PAIRS ? odd : even, c + 1);
  }
  if (c < width && w[c] != 0.0f) add(even, c);
  for (int k = 0; k < VECS; ++k)
    simd::store(a + LANES * k, PAIRS ? simd::add(even[k], odd[k]) : even[k]);
}

constexpr int MAX_VECS = 128 / LANES;  // attend checks d <= 128

template <int... V>
constexpr auto weigh_table(std::integer_sequence<int, V...>) {
  return std::array<void (*)(const float*, const float*, int64_t, float*), sizeof...(V)>{
      weigh_values_<V + 1>...};
}
constexpr auto WEIGH = weigh_table(std::make_integer_sequence<int, MAX_VECS>{});

void weigh_values(int64_t vecs, const float* w, const float* v, int64_t width, float* a) {
  WEIGH[vecs - 1](w, v, width, a);
}

namespace {

// One cache's part of an attention call: its queries [heads, n, d] (head and row strides),
// its keys and values (a key head's `columns` keys contiguous, heads `kstride`/`vstride`
// apart), which columns each query sees (null: all) and where its output rows go.
struct Job {
  const float* q;
  int64_t qhead, qrow;
  const float* k;
  const float* v;
  int64_t kstride, vstride;
  int64_t n, columns;
  const bool* seen;
  float* out;
  int64_t spans = 1, span = 0, first = 0;  // set by attend_jobs
};

// Every job's attention, its units in one parallel region (see attend).
void attend_jobs(std::vector<Job>& jobs, int64_t heads, int64_t kv, int64_t d, float s) {
  const int64_t group = heads / kv, vecs = d / LANES;
  const int64_t threads = at::get_num_threads();
  int64_t units = 0, work = 0;
  for (Job& job : jobs) {
    // spans of at least 128 columns, as many as give every thread four units
    const int64_t want = std::max<int64_t>(1, (4 * threads + kv * job.n - 1) / (kv * job.n));
    job.spans = std::max<int64_t>(1, std::min(want, job.columns / 128));
    job.span = (job.columns + job.spans - 1) / job.spans;
    job.first = units;
    units += kv * job.n * job.spans;
    work += job.columns * d * heads * job.n;
  }
  std::vector<int64_t> owner(units);  // each unit's job
  for (int64_t i = 0; i < static_cast<int64_t>(jobs.size()); ++i) {
    const Job& job = jobs[i];
    std::fill(owner.begin() + job.first, owner.begin() + job.first + kv * job.n * job.spans, i);
  }
  // per (unit, head of its group): the scores' maximum, the exponentials' sum, the values'
  // weighted sum [d]
  std::vector<float> top(units * group), total(units * group), acc(units * group * d);
  constexpr int64_t AHEAD = 16;  // columns prefetched ahead (hints: no fault past the end)
  const int64_t grain = work < (1 << 14) ? units : 1;
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> score;
    for (int64_t u = u0; u < u1; ++u) {
      const Job& job = jobs[owner[u]];
      const int64_t n = job.n, spans = job.spans, columns = job.columns, local = u - job.first;
      const int64_t g = local / (n * spans), r = (local / spans) % n;
      const int64_t c0 = (local % spans) * job.span;
      const int64_t width = std::min(columns, c0 + job.span) - c0;
      if (static_cast<int64_t>(score.size()) < width + 16) score.resize(width + 16);
      const float* kh = job.k + g * job.kstride + c0 * d;
      const float* vh = job.v + g * job.vstride + c0 * d;
      const bool* row_seen = job.seen ? job.seen + r * columns + c0 : nullptr;
      for (int64_t j = 0; j < group; ++j) {
        const int64_t h = g * group + j, slot = u * group + j;
        const float* qh = job.q + h * job.qhead + r * job.qrow;
        float best = -INFINITY;
        for (int64_t c = 0; c < width; ++c) {
          if (j == 0) {  // the first head streams the span: fetch keys ahead, values for later
            const float* key = kh + (c + AHEAD) * d;
            const float* value = vh + (c + AHEAD) * d;
            for (int64_t k = 0; k < d; k += 16) {
              _mm_prefetch(reinterpret_cast<const char*>(key + k), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(value + k), _MM_HINT_T1);
            }
          }
          if (row_seen && !row_seen[c]) {
            score[c] = -INFINITY;
            continue;
          }
          vec dot = simd::zero();
          for (int64_t k = 0; k < d; k += LANES)
            dot = simd::fmadd(simd::load(qh + k), simd::load(kh + c * d + k), dot);
          score[c] = simd::sum(dot) * s;
          best = std::max(best, score[c]);
        }
        float* a = acc.data() + slot * d;
        top[slot] = best;
        if (best == -INFINITY) {  // nothing seen in this span
          total[slot] = 0.0f;
          std::fill(a, a + d, 0.0f);
          continue;
        }
        const vec shift = simd::set1(best);
        vec sum = simd::zero();
        int64_t c = 0;
        for (; c + LANES <= width; c += LANES) {
          const vec e = simd::exp(simd::sub(simd::load(score.data() + c), shift));
          simd::store(score.data() + c, e);
          sum = simd::add(sum, e);
        }
        if (c < width) {  // the last few: the other lanes' exponentials are not added
          const vec e = simd::exp(simd::sub(simd::load_first(score.data() + c, width - c), shift));
          simd::store_first(score.data() + c, e, width - c);
          sum = simd::add(sum, simd::load_first(score.data() + c, width - c));
        }
        total[slot] = simd::sum(sum);
        weigh_values(vecs, score.data(), vh, width, a);
      }
    }
  });
  // merge the spans of each job's (query, head)
  for (const Job& job : jobs) {
    for (int64_t r = 0; r < job.n; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / group, j = h % group;
        const int64_t first = job.first + (g * job.n + r) * job.spans;  // its first span's unit
        float best = -INFINITY;
        for (int64_t t = 0; t < job.spans; ++t)
          best = std::max(best, top[(first + t) * group + j]);
        TORCH_CHECK(best > -INFINITY, "attend: query ", r, " sees no column");
        float sum = 0.0f;
        vec o[MAX_VECS];
        for (int64_t k = 0; k < vecs; ++k) o[k] = simd::zero();
        for (int64_t t = 0; t < job.spans; ++t) {
          const int64_t slot = (first + t) * group + j;
          if (total[slot] == 0.0f) continue;
          const float w = std::exp(top[slot] - best);
          sum += w * total[slot];
          const vec wv = simd::set1(w);
          for (int64_t k = 0; k < vecs; ++k)
            o[k] = simd::fmadd(wv, simd::load(acc.data() + slot * d + LANES * k), o[k]);
        }
        const vec inv = simd::set1(1.0f / sum);
        float* dst = job.out + r * heads * d + h * d;
        for (int64_t k = 0; k < vecs; ++k) simd::store(dst + LANES * k, simd::mul(o[k], inv));
      }
    }
  }
}

void check_heads(int64_t heads, int64_t kv, int64_t d) {
  TORCH_CHECK(d % 16 == 0 && d <= 128 && kv > 0 && heads % kv == 0,
              "attend: head sizes (d a multiple of 16, at most 128)");
}

const bool* mask_of(const c10::optional<Tensor>& mask, int64_t n, int64_t columns) {
  if (!mask.has_value()) return nullptr;
  TORCH_CHECK(mask->scalar_type() == torch::kBool && mask->is_contiguous() && mask->dim() == 2 &&
                  mask->size(0) == n && mask->size(1) == columns,
              "attend: a contiguous bool mask [n, columns]");
  return mask->data_ptr<bool>();
}

}  // namespace

// The attention of a few queries: q [heads, n, d] (each query's d numbers contiguous) over
// keys and values [1, kv_heads, columns, d] (each key's d numbers contiguous; the heads may be
// further apart, as in a cache's storage), the query heads grouped onto the key heads in
// order; query r does not see the columns where `mask` [n, columns] is false. Returns
// [n, heads * d].
//
// The work is split into (key head, query, span of columns) units over the threads: a unit
// reads its span of keys and values from memory once for all the query heads of its group
// (the later heads find them in cache) and keeps, per query head, its scores' maximum, the
// sum of their exponentials and the weighted sum of the values; the spans are then merged
// as flash-decoding merges them. Spans give a one-token step (three key heads, say) enough
// units for every thread.
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
  check_heads(heads, kv, d);
  TORCH_CHECK(keys.size(3) == d && columns > 0 && n > 0,
              "attend: head sizes (d a multiple of 16, at most 128)");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) == d && values.stride(3) == 1 &&
                  values.stride(2) == d,
              "attend: each key's numbers contiguous");
  auto out = torch::empty({n, heads * d}, q.options());
  std::vector<Job> jobs{{q.data_ptr<float>(), q.stride(0), q.stride(1), keys.data_ptr<float>(),
                         values.data_ptr<float>(), keys.stride(1), values.stride(1), n, columns,
                         mask_of(mask, n, columns), out.data_ptr<float>()}};
  attend_jobs(jobs, heads, kv, d, static_cast<float>(scale));
  return out;
}

// Several caches' attention in one call, each cache's block of keys and values written into
// its storage first: the rows bounds[i]..bounds[i + 1] of q [heads, rows, d] and of k and v
// [kv_heads, rows, d] (each row's d numbers contiguous) are cache i's; its keys and values go
// to slots starts[i].. of keys[i] and values[i] [1, kv_heads, capacity, d] (contiguous), and
// its queries attend over their first columns[i] slots (masks[i] [n, columns[i]] as in
// attend). Writes each cache's output rows into out [rows, heads * d]. One parallel region
// for every cache: a batched step of many sessions calls this once a layer, not once a
// session.
void attend_many(Tensor out, const Tensor& q, const Tensor& k, const Tensor& v,
                 const std::vector<Tensor>& keys, const std::vector<Tensor>& values,
                 const std::vector<int64_t>& bounds, const std::vector<int64_t>& starts,
                 const std::vector<int64_t>& columns,
                 const std::vector<c10::optional<Tensor>>& masks, double scale) {
  check_float(out, "attend_many's output");
  check_float(q, "attend_many's queries");
  check_float(k, "attend_many's keys");
  check_float(v, "attend_many's values");
  const int64_t caches = static_cast<int64_t>(keys.size());
  TORCH_CHECK(values.size() == keys.size() && starts.size() == keys.size() &&
                  columns.size() == keys.size() && masks.size() == keys.size() &&
                  static_cast<int64_t>(bounds.size()) == caches + 1,
              "attend_many: one storage, start, column count and mask per cache");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && q.stride(2) == 1 &&
                  k.stride(2) == 1 && v.stride(2) == 1,
              "attend_many takes q [heads, rows, d], k and v [kv_heads, rows, d]");
  const int64_t heads = q.size(0), rows = q.size(1), d = q.size(2), kv = k.size(0);
  check_heads(heads, kv, d);
  TORCH_CHECK(k.size(1) == rows && k.size(2) == d && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == rows && out.size(1) == heads * d,
              "attend_many: rows and output [rows, heads * d]");
  TORCH_CHECK(bounds.front() == 0 && bounds.back() == rows, "attend_many: bounds cover the rows");
  std::vector<Job> jobs;
  for (int64_t i = 0; i < caches; ++i) {
    const Tensor& ks = keys[i];
    const Tensor& vs = values[i];
    check_float(ks, "attend_many's key storage");
    check_float(vs, "attend_many's value storage");
    TORCH_CHECK(ks.dim() == 4 && ks.size(0) == 1 && ks.size(1) == kv && ks.size(3) == d &&
                    ks.sizes() == vs.sizes() && ks.is_contiguous() && vs.is_contiguous(),
                "attend_many: storage [1, kv_heads, capacity, d], contiguous");
    const int64_t a = bounds[i], n = bounds[i + 1] - a, capacity = ks.size(2);
    TORCH_CHECK(n > 0 && starts[i] >= 0 && starts[i] + n <= columns[i] &&
                    columns[i] <= capacity,
                "attend_many: cache ", i, "'s block must fit its storage and columns");
    float* kp = ks.data_ptr<float>();
    float* vp = vs.data_ptr<float>();
    for (int64_t g = 0; g < kv; ++g) {
      for (int64_t r = 0; r < n; ++r) {
        const int64_t slot = (g * capacity + starts[i] + r) * d;
        std::copy_n(k.data_ptr<float>() + g * k.stride(0) + (a + r) * k.stride(1), d, kp + slot);
        std::copy_n(v.data_ptr<float>() + g * v.stride(0) + (a + r) * v.stride(1), d, vp + slot);
      }
    }
    jobs.push_back({q.data_ptr<float>() + a * q.stride(1), q.stride(0), q.stride(1), kp, vp,
                    capacity * d, capacity * d, n, columns[i], mask_of(masks[i], n, columns[i]),
                    out.data_ptr<float>() + a * heads * d});
  }
  attend_jobs(jobs, heads, kv, d, static_cast<float>(scale));
}

// Eviction's moves, every layer's in one call: in each storage [1, kv_heads, capacity, d]
// (contiguous, any dtype: entries are copied as bytes), the entries of slots `sources` go to
// slots `destinations`, every source read before any destination is written (as
// storage[:, :, destinations] = storage[:, :, sources] does). A step of a full cache moves
// one entry in each of thirty layers; as indexing operations that is sixty dispatches.
void move_slots(const std::vector<Tensor>& storages, const Tensor& sources,
                const Tensor& destinations) {
  TORCH_CHECK(sources.scalar_type() == torch::kLong && destinations.scalar_type() == torch::kLong &&
                  sources.dim() == 1 && sources.sizes() == destinations.sizes() &&
                  sources.is_contiguous() && destinations.is_contiguous() &&
                  sources.device().is_cpu() && destinations.device().is_cpu(),
              "move_slots: sources and destinations, int64 [n] on the CPU");
  const int64_t n = sources.size(0);
  const int64_t* from = sources.data_ptr<int64_t>();
  const int64_t* to = destinations.data_ptr<int64_t>();
  for (const Tensor& s : storages) {  // every check before any move: none or all are made
    TORCH_CHECK(s.dim() == 4 && s.size(0) == 1 && s.is_contiguous() && s.device().is_cpu(),
                "move_slots: storage [1, kv_heads, capacity, d], contiguous, on the CPU");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(0 <= from[i] && from[i] < s.size(2) && 0 <= to[i] && to[i] < s.size(2),
                  "move_slots: slot out of range");
  }
  std::vector<char> held;
  for (const Tensor& s : storages) {
    const int64_t heads = s.size(1), capacity = s.size(2);
    const int64_t entry = s.size(3) * s.element_size();
    char* base = static_cast<char*>(s.data_ptr());
    held.resize(n * entry);
    for (int64_t g = 0; g < heads; ++g) {
      char* head = base + g * capacity * entry;
      for (int64_t i = 0; i < n; ++i) std::copy_n(head + from[i] * entry, entry, &held[i * entry]);
      for (int64_t i = 0; i < n; ++i) std::copy_n(&held[i * entry], entry, head + to[i] * entry);
    }
  }
}

// One decoder layer of a few float32 rows in one call: Llama's RMSNorm, q/k/v projection,
// rotary embedding, attention, output projection, RMSNorm, SiLU-gated MLP and both residuals,
// the same operations kakeya_lab/backends/torch_lean.py runs one by one (a one-token step is
// mostly the dispatch between its small operations). The rows x [rows, hidden] are the blocks
// of one or more caches (cache c's rows bounds[c]..bounds[c + 1]); each block's keys and
// values go to slots starts[c].. of its storage keys[c]/values[c] [1, kv_heads, capacity, d]
// and its rows attend over the first columns[c] slots (masks[c] [rows, columns] or None), as
// attend_many does. The four projections (q/k/v stacked, output, gate/up stacked, down; no
// biases) are whatever product the caller gives: float32 weights on the few-row product, or
// read from their exact integer forms to the same bits (float_layer; exact.cpp), or packed
// int4 weights on integer dot products (int4_layer, int4.cpp).
#include <torch/types.h>

#include <vector>

#include "kernels.h"

torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                            const torch::Tensor& norm2, double eps, const Product& product,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                            int64_t kv_heads, const std::vector<torch::Tensor>& keys,
                            const std::vector<torch::Tensor>& values,
                            const std::vector<int64_t>& bounds,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& columns,
                            const std::vector<c10::optional<torch::Tensor>>& masks,
                            double scale) {
  TORCH_CHECK(x.dim() == 2 && cos.dim() == 2 && cos.size(0) == x.size(0),
              "a decoder layer takes rows [n, hidden] and their rotary tables [n, head_dim]");
  const int64_t n = x.size(0), d = cos.size(1);
  torch::Tensor rows = product(rms_norm(x, norm1, eps), 0);
  TORCH_CHECK(rows.size(1) == (heads + 2 * kv_heads) * d, "decoder layer: q/k/v widths");
  rows = rows.view({n, heads + 2 * kv_heads, d});
  rotate_(rows, cos, sin, heads + kv_heads);
  const torch::Tensor by_head = rows.transpose(0, 1);
  const torch::Tensor attended = torch::empty({n, heads * d}, x.options());
  attend_many(attended, by_head.slice(0, 0, heads), by_head.slice(0, heads, heads + kv_heads),
              by_head.slice(0, heads + kv_heads), keys, values, bounds, starts, columns, masks,
              scale);
  const torch::Tensor mid = x + product(attended, 1);
  const torch::Tensor gate_up = product(rms_norm(mid, norm2, eps), 2);
  const int64_t width = gate_up.size(1) / 2;
  const torch::Tensor act = at::silu(gate_up.slice(1, 0, width)) * gate_up.slice(1, width);
  return mid + product(act.contiguous(), 3);
}

torch::Tensor float_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                          const torch::Tensor& norm2, double eps,
                          const std::vector<torch::Tensor>& weights, const torch::Tensor& cos,
                          const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                          const std::vector<torch::Tensor>& keys,
                          const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& bounds, const std::vector<int64_t>& starts,
                          const std::vector<int64_t>& columns,
                          const std::vector<c10::optional<torch::Tensor>>& masks, double scale) {
  TORCH_CHECK(weights.size() == 4 || weights.size() == 8,
              "float_layer: the float32 weights of 4 projections, or their exact forms' "
              "(codes, so)");
  const Product product = [&](const torch::Tensor& rows, int i) {
    return weights.size() == 4 ? rows_product(rows, weights[i])
                               : exact_product(rows, weights[2 * i], weights[2 * i + 1]);
  };
  return decoder_layer(x, norm1, norm2, eps, product, cos, sin, heads, kv_heads, keys, values,
                       bounds, starts, columns, masks, scale);
}

// The functions of this folder's sources that another source calls or bindings.cpp binds:
// one set of declarations, included by each source that defines or uses them (so a
// definition that drifts from its declaration fails to compile).
#pragma once

// torch/types.h, not torch/extension.h (pybind11 and the whole C++ API): only bindings.cpp
// needs those, and each other source compiles in about a third of the time without them
#include <torch/types.h>

#include <functional>
#include <vector>

// rows.cpp
torch::Tensor rows_product(torch::Tensor rows, torch::Tensor weight);

// step.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
void rotate_(torch::Tensor rows, const torch::Tensor& cos, const torch::Tensor& sin,
             int64_t heads);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys,
                     const torch::Tensor& values, const c10::optional<torch::Tensor>& mask,
                     double scale);
void attend_many(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k,
                 const torch::Tensor& v, const std::vector<torch::Tensor>& keys,
                 const std::vector<torch::Tensor>& values, const std::vector<int64_t>& bounds,
                 const std::vector<int64_t>& starts, const std::vector<int64_t>& columns,
                 const std::vector<c10::optional<torch::Tensor>>& masks, double scale);
void move_slots(const std::vector<torch::Tensor>& storages, const torch::Tensor& sources,
                const torch::Tensor& destinations);

// int4.cpp
torch::Tensor int4_product(const torch::Tensor& rows, const torch::Tensor& packed,
                           const torch::Tensor& scales);
torch::Tensor int4_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                         const torch::Tensor& norm2, double eps,
                         const std::vector<torch::Tensor>& weights, const torch::Tensor& cos,
                         const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                         const torch::Tensor& keys, const torch::Tensor& values, int64_t start,
                         int64_t columns, const c10::optional<torch::Tensor>& mask,
                         double scale);

// exact.cpp
torch::Tensor exact_product(const torch::Tensor& rows, const torch::Tensor& codes,
                             const torch::Tensor& so);

// layer.cpp: a decoder layer whose four projections (0: q/k/v, 1: output, 2: gate/up,
// 3: down) are product(rows, i)
using Product = std::function<torch::Tensor(const torch::Tensor&, int)>;
torch::Tensor decoder_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                            const torch::Tensor& norm2, double eps, const Product& product,
                            const torch::Tensor& cos, const torch::Tensor& sin, int64_t heads,
                            int64_t kv_heads, const std::vector<torch::Tensor>& keys,
                            const std::vector<torch::Tensor>& values,
                            const std::vector<int64_t>& bounds,
                            const std::vector<int64_t>& starts,
                            const std::vector<int64_t>& columns,
                            const std::vector<c10::optional<torch::Tensor>>& masks,
                            double scale);
torch::Tensor float_layer(const torch::Tensor& x, const torch::Tensor& norm1,
                          const torch::Tensor& norm2, double eps,
                          const std::vector<torch::Tensor>& weights, const torch::Tensor& cos,
                          const torch::Tensor& sin, int64_t heads, int64_t kv_heads,
                          const std::vector<torch::Tensor>& keys,
                          const std::vector<torch::Tensor>& values,
                          const std::vector<int64_t>& bounds, const std::vector<int64_t>& starts,
                          const std::vector<int64_t>& columns,
                          const std::vector<c10::optional<torch::Tensor>>& masks, double scale);

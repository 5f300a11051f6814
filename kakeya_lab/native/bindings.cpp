// The one Python module of every source in this folder (kakeya_lab/native/build.py builds it).
#include <torch/extension.h>

#include "kernels.h"

// Each call releases the GIL while it computes, as PyTorch's own operations do: other
// Python threads (the sessions of a batched forward, a server's handlers) run meanwhile.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("rows_product", &rows_product, "rows @ weight.T for 1 to 16 float32 rows", release());
  m.def("int4_product", &int4_product,
        "rows @ weight.T for float32 rows and int4 weights, on integer dot products",
        release());
  m.def("int4_layer", &int4_layer,
        "one decoder layer of a few float32 rows over one cache, every projection int4",
        release());
  m.def("float_layer", &float_layer,
        "one decoder layer of a few float32 rows over one or more caches, float32 weights "
        "(or their exact integer forms)",
        release());
  m.def("exact_product", &exact_product,
        "rows @ weight.T for 1 to 16 float32 rows, the weight read from its exact integer form",
        release());
  m.def("rms_norm", &rms_norm, "each row's RMSNorm, scaled by the weight", release());
  m.def("rotate_", &rotate_, "the rotary embedding of the first heads, in place", release());
  m.def("attend", &attend, "a few queries' attention over a cache's keys and values",
        release());
  m.def("attend_many", &attend_many,
        "several caches' attention, each block's keys and values written to its storage first",
        release());
  m.def("move_slots", &move_slots, "entries moved between slots in several caches' storage",
        release());
}

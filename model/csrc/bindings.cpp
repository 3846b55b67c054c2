// The Python module of the project's CPU kernels (model/kernels.py builds and loads it).
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draw_seed", &draw_seed, "one 64-bit draw of torch's default CPU generator");
  m.def("dropout_add", &dropout_add, "alpha * x + dropout(y) (x optional)");
  m.def("dropout_add_backward", &dropout_add_backward, "gradients of alpha * x + dropout(y)");
  m.def("short_attention_available", &short_attention_available, "whether this build has the attention kernel");
  m.attr("short_attention_max") = kShortAttentionMax;
  m.def("short_attention", &short_attention,
        "softmax(q kᵀ · scale) v per head on [B, T, H·D] tensors, keep: bool [B, Tk] or empty, differentiable");
}

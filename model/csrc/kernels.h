// The project's CPU kernels, built into one extension by model/kernels.py (bindings.cpp).
#pragma once

#include <torch/types.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <vector>

// dropout.cpp: the hashed dropout.
int64_t draw_seed();
torch::Tensor dropout_add(const torch::Tensor& y, const c10::optional<torch::Tensor>& x, double alpha, double p,
                          int64_t seed);
std::vector<torch::Tensor> dropout_add_backward(const torch::Tensor& g, double alpha, double p, int64_t seed,
                                                bool with_x);

// attention.cpp: attention for short sequences (at most kShortAttentionMax queries, keys and head width).
constexpr int kShortAttentionMax = 64;
bool short_attention_available();
torch::Tensor short_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t heads,
                              const torch::Tensor& keep, bool causal, double scale);

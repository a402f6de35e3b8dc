// The CPU kernels' entry points, shared by the Python bindings (bindings.cpp) and the kernels
// that call each other (decode_layers_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                                     torch::Tensor tables, torch::Tensor lens, double scale);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                              torch::Tensor tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale);
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor kv,
                     torch::Tensor slot_block, torch::Tensor slot_offset);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x,
                                              c10::optional<torch::Tensor> residual,
                                              torch::Tensor weight, double eps);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                       torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);
bool bf16_gemm_available();
torch::Tensor linear_bf16_vnni(torch::Tensor x, torch::Tensor packed,
                               c10::optional<torch::Tensor> bias, int64_t n, bool out_float32);
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos_sin, std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> kvs, torch::Tensor slot_block,
                                         torch::Tensor slot_offset, torch::Tensor tables,
                                         torch::Tensor lens, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim,
                                         int64_t intermediate, double eps, double scale);

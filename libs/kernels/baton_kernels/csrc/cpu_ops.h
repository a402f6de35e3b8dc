// The CPU kernels' entry points, shared by the Python bindings (bindings.cpp) and the kernels
// that call each other (decode_layers_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

// Both attention entry points take the layer's sliding window (W > 0: the query at position p
// sees keys p - W < j <= p only; 0: off) and score softcap (c > 0: each score s = scale * q.k
// becomes c * tanh(s / c) before the mask and softmax; 0: off), as
// baton_kernels.attention.base defines them. The caches are of the query's dtype or of an
// 8-bit float (e4m3fn, e5m2) holding K / k_scale and V / v_scale (the scales are ignored for
// the query's dtype).
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                                     torch::Tensor tables, torch::Tensor lens, double scale,
                                     int64_t window, double softcap, double k_scale,
                                     double v_scale);
torch::Tensor paged_attention(torch::Tensor query, torch::Tensor kc, torch::Tensor vc,
                              torch::Tensor tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale, int64_t window,
                              double softcap, double k_scale, double v_scale);
// A prompt chunk of a batch for prefill_attention: its query rows [start, start + len), its
// sequence's length (cached + new tokens) and its row of the block tables.
struct PromptChunk {
  int64_t start, len, seq_len, req;
};
// Whether prefill_attention runs on this CPU for this dtype and GQA group.
bool prefill_attention_available(const torch::Tensor& query, const torch::Tensor& kc);
// Causal attention of each chunk's rows over its sequence into `out`, within `window` and with
// scores capped by `softcap` (as above; bf16; checked by paged_attention, its only caller);
// `scale` includes an 8-bit cache's k_scale, `v_scale` multiplies the output.
void prefill_attention(const torch::Tensor& query, const torch::Tensor& kc,
                       const torch::Tensor& vc, const int64_t* tables, int64_t mb,
                       const std::vector<PromptChunk>& chunks, float scale, int64_t window,
                       float softcap, float v_scale, torch::Tensor& out);
// The new rows into the cache: copied, or into an 8-bit cache divided by the scales, saturated
// and rounded.
void write_kv_cache_(torch::Tensor key, torch::Tensor value, torch::Tensor kv,
                     torch::Tensor slot_block, torch::Tensor slot_offset, double k_scale,
                     double v_scale);
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x,
                                              c10::optional<torch::Tensor> residual,
                                              torch::Tensor weight, double eps);
void rotary_embedding_(torch::Tensor q, torch::Tensor k, torch::Tensor positions,
                       torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor gelu_tanh_and_mul(torch::Tensor x);
torch::Tensor argmax_rows(torch::Tensor x);
bool bf16_gemm_available();
// Whether linear_bf16_vnni can run on AMX tiles (built for an AMX CPU, the OS allows them), and
// a switch for it (returns the previous setting; on by default; K must be a multiple of 32).
bool amx_gemm_available();
bool use_amx_gemm(bool enabled);
torch::Tensor linear_bf16_vnni(torch::Tensor x, torch::Tensor packed,
                               c10::optional<torch::Tensor> bias, int64_t n, bool out_float32);
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos_sin, std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> kvs, torch::Tensor slot_block,
                                         torch::Tensor slot_offset, torch::Tensor tables,
                                         torch::Tensor lens, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim,
                                         int64_t intermediate, double eps, double scale,
                                         std::vector<int64_t> windows,
                                         std::vector<double> kv_scales);

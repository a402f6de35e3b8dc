// The decoder layers of a decode-only step on CPU in one call: the same kernels the Python layers
// call (fused_ops_cpu.cpp, gemm_bf16_cpu.cpp, paged_attention_cpu.cpp), in the same order, so the
// result is bit-identical to LlamaForCausalLM's layer loop. A decode step of the default model at
// 16 requests spent ~2 ms of ~21 in Python between these kernels (30 layers x ~10 module calls,
// views and checks) and took the GIL back ~300 times, each a chance to wait behind a worker's
// gRPC thread; here it is released once for all layers.
#include <torch/extension.h>

#include <vector>

#include "cpu_ops.h"

namespace {
// Per layer, in this order: input norm weight, packed qkv, qkv bias (empty: none), packed o,
// post-attention norm weight, packed gate_up, packed down.
constexpr size_t kPerLayer = 7;

int64_t packed_n(const torch::Tensor& packed) { return packed.size(0) * packed.size(2); }
}  // namespace

// hidden [T, H] (the embedding output), one token per request; kvs: each layer's cache view
// [blocks, 2, block_size, KVH, D], of the model's dtype or an 8-bit float; windows: each layer's
// sliding window (0: none), or empty for none; kv_scales: each layer's K and V scales of an
// 8-bit cache (2 per layer), or empty for 1. Returns (hidden, residual) after the last layer,
// before the final norm, as the Python loop does.
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, torch::Tensor positions,
                                         torch::Tensor cos_sin, std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> kvs, torch::Tensor slot_block,
                                         torch::Tensor slot_offset, torch::Tensor tables,
                                         torch::Tensor lens, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim,
                                         int64_t intermediate, double eps, double scale,
                                         std::vector<int64_t> windows,
                                         std::vector<double> kv_scales) {
  TORCH_CHECK(weights.size() == kvs.size() * kPerLayer, "expected ", kPerLayer,
              " weight tensors per layer, got ", weights.size(), " for ", kvs.size(), " layers");
  TORCH_CHECK(windows.empty() || windows.size() == kvs.size(),
              "windows: one per layer (0: none) or none at all, got ", windows.size(), " for ",
              kvs.size(), " layers");
  TORCH_CHECK(kv_scales.empty() || kv_scales.size() == 2 * kvs.size(),
              "kv_scales: K's and V's per layer or none at all, got ", kv_scales.size(), " for ",
              kvs.size(), " layers");
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [T, H]");
  const int64_t t = hidden.size(0), h = hidden.size(1);
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  c10::optional<torch::Tensor> residual;
  for (size_t layer = 0; layer < kvs.size(); ++layer) {
    const torch::Tensor* w = &weights[layer * kPerLayer];
    TORCH_CHECK(packed_n(w[1]) >= q_size + 2 * kv_size && packed_n(w[5]) >= 2 * intermediate,
                "layer ", layer, ": packed weights of the wrong shape");
    auto normed = fused_add_rms_norm(hidden, residual, w[0], eps);
    residual = normed[1];
    c10::optional<torch::Tensor> bias;
    if (w[2].numel() > 0) bias = w[2];
    auto qkv = linear_bf16_vnni(normed[0], w[1], bias, q_size + 2 * kv_size, false);
    auto q = qkv.narrow(1, 0, q_size).view({t, num_heads, head_dim});
    auto k = qkv.narrow(1, q_size, kv_size).view({t, num_kv_heads, head_dim});
    auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, num_kv_heads, head_dim});
    rotary_embedding_(q, k, positions, cos_sin);
    const torch::Tensor& kv = kvs[layer];
    const double k_scale = kv_scales.empty() ? 1.0 : kv_scales[2 * layer];
    const double v_scale = kv_scales.empty() ? 1.0 : kv_scales[2 * layer + 1];
    write_kv_cache_(k, v, kv, slot_block, slot_offset, k_scale, v_scale);
    // Each layer's sliding window (Mistral-7B-v0.1, Qwen2's local layers); no softcap: a model
    // with one must not take this loop.
    const int64_t window = windows.empty() ? 0 : windows[layer];
    auto attn = paged_decode_attention(q, kv.select(1, 0), kv.select(1, 1), tables, lens, scale,
                                       window, /*softcap=*/0.0, k_scale, v_scale);
    auto o = linear_bf16_vnni(attn.view({t, q_size}), w[3], c10::nullopt, h, false);
    auto normed2 = fused_add_rms_norm(o, residual, w[4], eps);
    auto gate_up = linear_bf16_vnni(normed2[0], w[5], c10::nullopt, 2 * intermediate, false);
    hidden = linear_bf16_vnni(silu_and_mul(gate_up), w[6], c10::nullopt, h, false);
  }
  TORCH_CHECK(residual.has_value(), "no layers");
  return {hidden, *residual};
}

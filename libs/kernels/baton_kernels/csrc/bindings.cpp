// The Python module of the CPU kernels (baton_kernels.cpu_ops.load_cpu_ops). Each releases the
// GIL while it computes (as torch's own ops do): in a worker, the gRPC thread that streams
// tokens must not wait for a layer's attention or norm.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <atomic>
#include <vector>

#include "cpu_ops.h"

// How many of torch's intra-op threads an at::parallel_for over `n` items of this module ran
// on: the module must be built with OpenMP, or its kernels silently run on one thread.
int64_t parallel_threads(int64_t n) {
  std::vector<std::atomic<int>> seen(static_cast<size_t>(at::get_num_threads()));
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int t = at::get_thread_num();
    if (t >= 0 && t < static_cast<int>(seen.size())) seen[static_cast<size_t>(t)] = 1;
  });
  int64_t count = 0;
  for (const auto& s : seen) count += s.load();
  return count;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  // window, softcap and the 8-bit caches' scales default to off, so callers that predate them
  // keep their meaning.
  m.def("paged_decode_attention", &paged_decode_attention, nogil, py::arg("query"),
        py::arg("kc"), py::arg("vc"), py::arg("tables"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("window") = 0, py::arg("softcap") = 0.0, py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0,
        "query [R, H, D], caches [blocks, block_size, KVH, D] (the query's dtype, or e4m3fn / "
        "e5m2 holding K / k_scale and V / v_scale), tables [R, max_blocks] int64, seq_lens [R] "
        "int64, scale, window (0: off), softcap (0: off), k_scale, v_scale -> [R, H, D]: each "
        "row over the last `window` tokens of its sequence, scores capped by softcap * tanh(s / "
        "softcap)");
  m.def("paged_attention", &paged_attention, nogil, py::arg("query"), py::arg("kc"),
        py::arg("vc"), py::arg("tables"), py::arg("seq_lens"), py::arg("query_start_loc"),
        py::arg("scale"), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        "query [T, H, D] (each request's new tokens in order), caches [blocks, block_size, KVH, "
        "D] (as paged_decode_attention's), tables [R, max_blocks] int64, seq_lens [R] int64 "
        "(cached + new), query_start_loc [R + 1] int64, scale, window (0: off), softcap (0: "
        "off), k_scale, v_scale -> [T, H, D]: causal attention over each request's cached and "
        "new tokens, the token at position p over p - window < j <= p only, scores capped by "
        "softcap * tanh(s / softcap)");
  m.def("write_kv_cache_", &write_kv_cache_, nogil, py::arg("key"), py::arg("value"),
        py::arg("kv"), py::arg("slot_block"), py::arg("slot_offset"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0,
        "key, value [T, KVH, D] into kv [blocks, 2, block_size, KVH, D] at (slot_block, "
        "slot_offset) [T] int64; an 8-bit kv (e4m3fn, e5m2) stores K / k_scale and V / v_scale, "
        "saturated and rounded to nearest even");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, nogil,
        "x [T, H], residual [T, H] or None (updated in place to x + residual), weight [H], eps "
        "-> (normed, residual)");
  m.def("rotary_embedding_", &rotary_embedding_, nogil,
        "q [T, Hq, D], k [T, Hk, D] rotated in place; positions [T] int64; cos_sin [P, 2, D]");
  m.def("silu_and_mul", &silu_and_mul, nogil, "x [T, 2I] -> silu(x[:, :I]) * x[:, I:]");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, nogil,
        "x [T, 2I] -> gelu(x[:, :I], approximate='tanh') * x[:, I:] (Gemma's GeGLU)");
  m.def("argmax_rows", &argmax_rows, nogil,
        "x [B, V] float32 or bf16 -> [B] int64: torch.argmax(x, dim=1) (first of ties, NaN wins)");
  m.def("bf16_gemm_available", &bf16_gemm_available,
        "whether linear_bf16_vnni was built (the CPU has AVX512-BF16)");
  m.def("amx_gemm_available", &amx_gemm_available,
        "whether linear_bf16_vnni runs on AMX tiles where K is a multiple of 32 (an AMX CPU)");
  m.def("use_amx_gemm", &use_amx_gemm, py::arg("enabled"),
        "turns linear_bf16_vnni's AMX path on or off (on by default); returns the previous "
        "setting");
  m.def("linear_bf16_vnni", &linear_bf16_vnni, nogil,
        "x [M, K] bf16, packed weight [ceil(N/16), ceil(K/2), 16, 2] bf16, bias [N] or None, N, "
        "out_float32 -> x W^T + b [M, N] (bf16, or float32)");
  m.def("decode_layers", &decode_layers, nogil, py::arg("hidden"), py::arg("positions"),
        py::arg("cos_sin"), py::arg("weights"), py::arg("kvs"), py::arg("slot_block"),
        py::arg("slot_offset"), py::arg("tables"), py::arg("seq_lens"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"),
        py::arg("scale"), py::arg("windows"), py::arg("kv_scales") = std::vector<double>{},
        "hidden [T, H], positions [T], cos_sin, weights (7 per layer: input norm, packed qkv, "
        "qkv bias or empty, packed o, post norm, packed gate_up, packed down), kv views per "
        "layer, slot_block, slot_offset, block tables, seq lens, num_heads, num_kv_heads, "
        "head_dim, intermediate, eps, scale, windows (per layer, 0: none; or empty), kv_scales "
        "(K's and V's per layer of 8-bit caches; or empty) -> (hidden, residual) after the last "
        "layer");
  m.def("parallel_threads", &parallel_threads, nogil,
        "n -> how many intra-op threads a parallel_for over n items ran on");
}

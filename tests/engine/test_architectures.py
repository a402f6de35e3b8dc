"""Each supported architecture, loaded from a Hugging Face folder (config.json + safetensors +
tokenizer), generates greedily exactly as transformers does. The models are tiny and randomly
initialised by transformers itself (nothing is downloaded); the tokenizer is the default model's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import (
    ARCHITECTURES,
    TINY,
    build_gemma3_vision_language,
    build_model,
    hf_greedy,
)

from baton import LLM, SamplingParams

TINY_HEAD = TINY["hidden_size"] // TINY["num_attention_heads"]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_architecture_matches_transformers(
    name: str, default_model_dir: Path, tmp_path: Path
) -> None:
    model = build_model(name, default_model_dir, tmp_path)
    prompts = [[10 + i for i in range(n)] for n in (5, 23, 40)]
    want = hf_greedy(model, prompts, 12)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [g.outputs[0].token_ids for g in got] == want


def test_longrope_takes_the_factors_of_the_context_served(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Phi-3's LongRoPE (its original context 32 here): an engine serving at most 32 tokens
    rotates with the short factors, one serving more with the long ones (as vLLM); each
    generates what transformers does for the sequences it serves: short ones under the
    first, a prompt longer than 32 under the second. The two sets give different tokens."""
    half = TINY_HEAD // 2
    scaling = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
               "long_factor": [1.0 + 3.0 * i for i in range(half)]}  # fmt: skip
    model = build_model("phi3", default_model_dir, tmp_path, rope_scaling=scaling,
                        original_max_position_embeddings=32)  # fmt: skip
    short, long = [[10 + i for i in range(n)] for n in (5, 18)], [[7 + 3 * i for i in range(40)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for max_model_len, prompts in ((32, short), (128, long + short)):
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=max_model_len,
                  kv_cache_memory=16 << 20)  # fmt: skip
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            got[max_model_len] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            llm.shutdown()
    assert got[32] == hf_greedy(model, short, 12)
    assert got[128][:1] == hf_greedy(model, long, 12)
    assert got[128][1:] != got[32]  # (the short prompts under the long factors)


# Hugging Face module names -> llama.cpp's tensor names, and each architecture's own
GGUF_NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}  # fmt: skip
MOE_NAMES = {
    "mlp.gate": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
GEMMA2_NAMES = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip


def _permuted(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's row order of a Llama Q or K projection (interleaved rotary halves)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(model: torch.nn.Module, path: Path, arch: str) -> None:
    """``model`` (a tiny Phi-3, Gemma or mixture of experts) written as llama.cpp writes it:
    Phi-3's fused projections and LongRoPE factor tensors, Gemma's norm weights plus one;
    experts stacked (Qwen's) or one tensor an expert (Mixtral's older files, under ``llama``,
    its Q and K rows permuted); the default model's tokenizer."""
    import gguf

    from baton_engine.model_loader import default_model_path

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if arch == "phi3":
        writer.add_rope_dimension_count(int(head_dim * cfg.partial_rotary_factor))
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":  # (newer llama.cpp files: a flag a layer)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if arch == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", cfg.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", cfg.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for field in gguf.GGUFReader(str(default_model_path())).fields.values():
        if field.name.startswith("tokenizer."):
            kind, value = field.types[0], field.contents()
            if kind == gguf.GGUFValueType.ARRAY:
                writer.add_array(field.name, value)
            elif kind == gguf.GGUFValueType.STRING:
                writer.add_string(field.name, value)
            else:
                writer.add_uint32(field.name, int(value))
    names = GGUF_NAMES | MOE_NAMES | (GEMMA2_NAMES if arch in ("gemma2", "gemma3") else {})
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        suffix = "bias" if name.endswith(".bias") else "weight"
        stem = name.removesuffix(f".{suffix}")
        layer = re.match(r"model\.layers\.(\d+)\.(.+)", stem)
        w = tensor.float()
        if layer and layer[2] == "mlp.experts.gate_up_proj":  # [E, 2I, H]: gate rows, up rows
            gate, up = w.chunk(2, dim=1)
            if arch == "llama":  # (Mixtral's older files: one tensor an expert)
                for e in range(w.shape[0]):
                    writer.add_tensor(f"blk.{layer[1]}.ffn_gate.{e}.weight", gate[e].numpy())
                    writer.add_tensor(f"blk.{layer[1]}.ffn_up.{e}.weight", up[e].numpy())
            else:
                writer.add_tensor(f"blk.{layer[1]}.ffn_gate_exps.weight", gate.numpy())
                writer.add_tensor(f"blk.{layer[1]}.ffn_up_exps.weight", up.numpy())
            continue
        if arch == "llama" and layer and layer[2] == "mlp.experts.down_proj":
            for e in range(w.shape[0]):
                writer.add_tensor(f"blk.{layer[1]}.ffn_down.{e}.weight", w[e].numpy())
            continue
        gguf_name = f"blk.{layer[1]}.{names[layer[2]]}" if layer else names[stem]
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        if arch == "llama" and gguf_name.split(".")[-1] in heads:
            w = _permuted(w, heads[gguf_name.split(".")[-1]])
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            w = w.reshape(-1)  # (llama.cpp's: a vector)
        writer.add_tensor(f"{gguf_name}.{suffix}", w.numpy())
    if arch == "phi3":
        for which in ("long", "short"):
            factors = np.array(cfg.rope_parameters[f"{which}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{which}.weight", factors)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_greedy(model: Any, arch: str, prompts: list[list[int]], tmp_path: Path) -> None:
    """``model`` as a GGUF, converted and served, generates what transformers does."""
    from baton_engine.model_loader import resolve_model

    _write_gguf(model, tmp_path / f"{arch}.gguf", arch)
    folder = resolve_model(str(tmp_path / f"{arch}.gguf"), cache_dir=tmp_path / "cache")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(g.outputs[0].token_ids) for g in got] == hf_greedy(model, prompts, 12)
    finally:
        llm.shutdown()


def test_a_phi3_gguf_generates_what_its_model_does(default_model_dir: Path, tmp_path: Path) -> None:
    """A Phi-3 GGUF (Phi-4-mini's kind: half of each head turned, LongRoPE) converts to the
    model transformers runs: fused projections, the factors and the rotation from the file."""
    from baton_engine.gguf_convert import convert_gguf

    half = int(TINY_HEAD * 0.5) // 2
    scaling = {"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(half)],
               "long_factor": [1.0 + 3.0 * i for i in range(half)]}  # fmt: skip
    model = build_model("phi3-partial-rotary", default_model_dir, tmp_path / "hf",
                        rope_scaling=scaling, original_max_position_embeddings=32)  # fmt: skip
    # (prompts beyond 32 tokens: transformers takes the long factors, as this engine does)
    _gguf_greedy(model, "phi3", [[7 + 3 * i for i in range(n)] for n in (40, 57)], tmp_path)
    (tmp_path / "out").mkdir()
    convert_gguf(tmp_path / "phi3.gguf", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["partial_rotary_factor"] == 0.5
    assert config["rope_scaling"]["long_factor"] == scaling["long_factor"]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_gemma_gguf_generates_what_its_model_does(
    arch: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """Gemma GGUFs as llama.cpp writes them (norms plus one; Gemma 2's caps and window in the
    metadata; Gemma 3's q/k norms, its global layers' scaled rope, which layers slide):
    served as transformers runs the model. Queries scaled by 1/sqrt(head size), as every
    Gemma but the 27B (the file does not say: llama.cpp's rule)."""
    overrides: dict[str, Any] = {}
    if arch == "gemma2":
        overrides = {"query_pre_attn_scalar": 256}  # (its head size)
    if arch == "gemma3":
        rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}  # fmt: skip
        kinds = ["sliding_attention", "full_attention", "sliding_attention"]
        overrides = {"query_pre_attn_scalar": 64, "num_hidden_layers": 3, "rope_parameters": rope,
                     "layer_types": kinds}  # fmt: skip
    model = build_model(arch, default_model_dir, tmp_path / "hf", **overrides)
    _gguf_greedy(model, arch, [[10 + i for i in range(n)] for n in (5, 40)], tmp_path)


@pytest.mark.parametrize(
    ("name", "arch"), [("mixtral", "llama"), ("qwen2_moe", "qwen2moe"), ("qwen3_moe", "qwen3moe")]
)
def test_a_mixture_of_experts_gguf_generates_what_its_model_does(
    name: str, arch: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """GGUF mixtures of experts as llama.cpp writes them: Mixtral under ``llama`` with an
    expert count (one tensor an expert, as its older files; Q and K rows permuted), Qwen2-MoE
    (stacked experts, a shared expert and its gate; layer 0 dense: no router) and Qwen3-MoE
    (its top 2 renormalized, llama.cpp's rule): served as transformers runs the model."""
    model = build_model(name, default_model_dir, tmp_path / "hf")
    _gguf_greedy(model, arch, [[10 + i for i in range(n)] for n in (5, 40)], tmp_path)


def test_the_language_model_of_gemma3_vision_language(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Gemma 3 4B/12B/27B (``Gemma3ForConditionalGeneration``): its language model serves text
    prompts as transformers' whole model generates them; the vision tower is not loaded."""
    model = build_gemma3_vision_language(default_model_dir, tmp_path)
    prompts = [[10 + i for i in range(n)] for n in (5, 40)]
    want = hf_greedy(model, prompts, 12)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == want
        runner = llm.engine.core.runner
        assert not any("vision" in name for name, _ in runner.model.named_parameters())
    finally:
        llm.shutdown()
    # vLLM's hf_overrides replace a key of the text_config inside it, keeping the others
    from baton_engine.config import ModelConfig

    overridden = ModelConfig.from_path(tmp_path, {"text_config": {"sliding_window": 8}})
    assert overridden.sliding_window == 8 and overridden.num_layers == 2


def test_a_gemma3_text_config_takes_transformers_defaults() -> None:
    """Gemma 3 4B's config.json names 6 keys of its language model; the rest are
    transformers' defaults (8 heads of 256, 4 KV heads, one global layer in 6, the local
    layers' rope at theta 10,000, the global ones' scaled)."""
    from baton_engine.config import ModelConfig

    config = ModelConfig.from_hf_dict({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    })  # fmt: skip
    assert (config.architecture, config.num_layers, config.hidden_size) == ("gemma3", 34, 2560)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 4, 256)
    assert (config.vocab_size, config.eos_token_ids, config.torch_dtype) == (
        262_208, (1, 106), "bfloat16"
    )  # fmt: skip
    assert [config.layer_window(i) for i in range(6)] == [1024] * 5 + [0]
    assert config.rope_theta == 1_000_000.0 and config.local_rope_theta == 10_000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.attention_multiplier == 256**-0.5 and config.qk_norm
    assert config.tie_word_embeddings and config.text_of_multimodal


def test_dummy_weights_run(default_model_dir: Path) -> None:
    llm = LLM(
        str(default_model_dir), load_format="dummy", max_model_len=128, kv_cache_memory=16 << 20
    )
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(["Hello there"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_disable_sliding_window_serves_up_to_the_window(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's --disable-sliding-window: full attention, which equals the model's up to its
    window, so sequences are served up to the window's length and a longer max_model_len is
    refused. (Without it the window is computed: the sliding-window architectures above.)"""
    from baton_engine.errors import InvalidRequestError

    model = build_model("mistral", default_model_dir, tmp_path, sliding_window=24)
    prompt = [10 + i for i in range(14)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20,
              disable_sliding_window=True)  # fmt: skip
    try:
        assert llm.engine.core.max_model_len == 24
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        (got,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(got.outputs[0].token_ids) == out[0, len(prompt) :].tolist()
    finally:
        llm.shutdown()
    with pytest.raises(InvalidRequestError, match="sliding window of 24 tokens"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, disable_sliding_window=True)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory=16 << 20)
    try:
        assert llm.engine.core.max_model_len == 512  # (the model's positions)
    finally:
        llm.shutdown()


def test_gemma2_logprobs_match_transformers(default_model_dir: Path, tmp_path: Path) -> None:
    """Gemma 2 caps its logits (c * tanh(x / c)): greedy tokens cannot show the cap, the
    logprobs do."""
    model = build_model("gemma2", default_model_dir, tmp_path)
    prompt = [10 + i for i in range(23)]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, -1].float()
    want = torch.log_softmax(logits, -1)
    cap = 5.0  # (tiny_models' final_logit_softcapping)
    uncapped = torch.log_softmax(torch.atanh(logits / cap) * cap, -1)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    got = out.outputs[0].logprobs[0]
    assert set(got) == set(want.topk(5).indices.tolist())
    for token, logprob in got.items():
        assert abs(logprob.logprob - want[token].item()) < 1e-4
        assert abs(logprob.logprob - uncapped[token].item()) > 1e-2  # (the cap shows)


def test_hf_overrides_replace_the_configs_keys(default_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's hf_overrides: a folder without rope scaling, served with YaRN's, generates what
    transformers does with YaRN in the config (the same weights)."""
    from baton_engine.errors import InvalidRequestError

    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    build_model("qwen2", default_model_dir, tmp_path / "plain")  # rope_type "default"
    model = build_model("qwen2", default_model_dir, tmp_path / "yarn", rope_scaling=yarn)
    prompt = [10 + i for i in range(40)]
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                             do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    want = out[0, len(prompt) :].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = {}
    for name, overrides in (("plain", None), ("overridden", json.dumps({"rope_scaling": yarn}))):
        llm = LLM(str(tmp_path / "plain"), dtype="float32", kv_cache_memory=16 << 20,
                  hf_overrides=overrides)  # fmt: skip
        try:
            (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            got[name] = list(result.outputs[0].token_ids)
            if overrides:  # the positions YaRN serves: 4 x 64
                assert llm.engine.core.max_model_len == 256
        finally:
            llm.shutdown()
    assert got["overridden"] == want != got["plain"]
    with pytest.raises(InvalidRequestError, match="hf_overrides must be a JSON object"):
        LLM(str(tmp_path / "plain"), hf_overrides="[1]")

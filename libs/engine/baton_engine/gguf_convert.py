"""Convert a GGUF checkpoint into a Hugging Face-style model folder.

The folder holds ``config.json``, ``model.safetensors`` (float32, Hugging Face tensor names and
layouts) and the tokenizer files written by ``transformers`` (``tokenizer.json``,
``tokenizer_config.json`` and the chat template). Supported GGUF architectures: ``llama``,
``qwen2``, ``qwen3``, ``phi3`` (Phi-3, Phi-3.5, Phi-4, Phi-4-mini: its fused q/k/v and
gate/up kept fused, as Hugging Face's checkpoints hold them; its LongRoPE factors, partial
rotation and sliding window from the metadata), ``gemma2`` and ``gemma3`` (whose norm weights
llama.cpp stores plus one: Hugging Face's are the weights minus one; transformers, which builds
the tokenizer, reads no Gemma 1 GGUF), and mixtures of experts: ``qwen2moe`` (Qwen1.5-MoE,
Qwen2-MoE: a shared expert), ``qwen3moe`` and ``llama`` with experts (Mixtral), their experts
stacked as transformers >= 5 holds them (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``; older Mixtral files' one tensor an expert kept as
they are), a layer without a router dense (``mlp_only_layers``). Callers
should use :func:`baton_engine.model_loader.resolve_model`, which caches the result; this
module only does the conversion.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from baton_engine.errors import ModelLoadError

# GGUF ``general.architecture`` -> (HF architecture, HF model_type).
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# Gemma 2 and 3's four norms a layer: llama.cpp's ffn_norm is the one before the MLP
_GEMMA2_BLOCK = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# the number of layers of Gemma 2 and 3's 27B, which scale queries by 1/sqrt(hidden / heads)
# where the others scale by 1/sqrt(head_dim) (llama.cpp's rule: the file does not say)
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Phi-3's fused projections: its ``ffn_up`` holds gate and up (Llama's holds up alone)
_PHI3_BLOCK = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# LongRoPE's factors, held as tensors (read into the config, not into the weights)
_ROPE_FACTORS = {
    "rope_factors_long.weight": "long_factor",
    "rope_factors_short.weight": "short_factor",
}

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# GGUF per-block tensor stem -> HF name inside ``model.layers.N.``.
_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Mixtures of experts: the router, the stacked experts (gate and up stacked together after
# reading: _stack_experts) and Qwen2-MoE's shared expert and its gate
_MOE_BLOCK = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# older Mixtral files: one tensor an expert (blk.N.ffn_gate.E.weight)
_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """Map a GGUF tensor name of architecture ``arch`` to its Hugging Face name.

    Raises ModelLoadError for a tensor this converter does not know (for example Llama 3.1's
    ``rope_freqs.weight``), since dropping it silently would give a different model.
    """
    if gguf_name in _TOP_LEVEL:
        return _TOP_LEVEL[gguf_name]
    expert = _EXPERT_RE.fullmatch(gguf_name)
    if expert is not None and arch in _MOE_ARCHS:
        layer, part, index = expert.groups()
        return f"model.layers.{layer}.mlp.experts.{index}.{part}_proj.weight"
    m = _BLOCK_RE.fullmatch(gguf_name)
    block = {"phi3": _BLOCK | _PHI3_BLOCK, "gemma2": _BLOCK | _GEMMA2_BLOCK,
             "gemma3_text": _BLOCK | _GEMMA2_BLOCK}.get(arch, _BLOCK)  # fmt: skip
    if arch in _MOE_ARCHS:
        block = block | _MOE_BLOCK
    if m is None or m.group(2) not in block:
        raise ModelLoadError(f"unsupported GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"


_MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a Llama Q or K projection (weight or bias).

    llama.cpp's converter stores ``w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)``
    (interleaved rotary halves); this returns Hugging Face's layout (rotate-half). Pass the number
    of query heads for Q and the number of KV heads for K.
    """
    rest = w.shape[1:]
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(v: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(v)))


def build_hf_config(reader: Any, names: set[str]) -> dict[str, Any]:
    """Build a Hugging Face ``config.json`` dict from a GGUFReader's metadata and its tensors'
    ``names``: without an ``output.weight`` the LM head is tied to the token embedding; a
    mixture of experts' layers without a router (``ffn_gate_inp``) are dense."""
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}"
        )
    hf_arch, model_type = _ARCHITECTURES[arch]

    def req(key: str) -> Any:
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
        return v

    num_experts = int(_field(reader, f"{arch}.expert_count", 0) or 0)
    if num_experts and arch == "llama":
        hf_arch, model_type = "MixtralForCausalLM", "mixtral"
    elif num_experts and model_type not in _MOE_ARCHS:
        raise ModelLoadError(
            f"GGUF files of {arch} mixtures of experts are not supported (of llama, qwen2moe "
            "and qwen3moe they are): serve the model's Hugging Face folder"
        )
    elif not num_experts and model_type in _MOE_ARCHS:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_count")
    hidden, n_head = int(req("embedding_length")), int(req("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(req("vocab_size"))
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(
            _field(reader, f"{arch}.feed_forward_length", 0)
            or (req("expert_feed_forward_length") if num_experts else req("feed_forward_length"))
        ),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // n_head)),
        "hidden_act": "silu",
        "rms_norm_eps": _f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch in ("qwen2", "qwen2moe"),
        "torch_dtype": "bfloat16",
    }
    head_dim = cfg["head_dim"]
    rotated = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rotated != head_dim:  # (Phi-4-mini: 3/4 of each head)
        cfg["partial_rotary_factor"] = rotated / head_dim
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if arch.startswith("gemma"):
        cfg.update(_gemma_config(reader, arch, cfg))
    if num_experts:
        cfg.update(_moe_config(reader, arch, model_type, num_experts, cfg, names))
    for hf_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        v = _field(reader, gguf_key)
        if v is not None:
            cfg[hf_key] = int(v)
    return cfg


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write ``gguf_path`` as a Hugging Face model folder into the existing folder ``out_dir``.

    Every tensor is dequantized to float32; Llama Q/K rows are un-permuted so that the weights
    equal Hugging Face's. Raises ModelLoadError if the file is not a readable GGUF of a supported
    architecture; ``out_dir`` may then hold partial output (the caller owns its cleanup).
    """
    import gguf
    from gguf.quants import dequantize

    try:
        reader = gguf.GGUFReader(str(gguf_path))
        names = {t.name for t in reader.tensors}
        cfg = build_hf_config(reader, names)
        arch = cfg["model_type"]
        heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
        state: dict[str, torch.Tensor] = {}
        factors: dict[str, list[float]] = {}
        for t in reader.tensors:
            # The reader's t.shape is GGUF order (innermost first); dequantize returns numpy
            # order, i.e. the Hugging Face (out_features, in_features) layout.
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            if t.name in _ROPE_FACTORS and arch == "phi3":
                factors[_ROPE_FACTORS[t.name]] = [float(f) for f in w.reshape(-1)]
                continue
            hf_name = hf_tensor_name(t.name, arch)
            expected = tuple(int(d) for d in reversed(t.shape))
            if w.shape != expected:
                w = w.reshape(expected)
            stem = t.name.split(".")[2] if t.name.startswith("blk.") else ""
            if arch in ("llama", "mixtral") and stem in heads:
                w = unpermute_qk(w, heads[stem])
            if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
                w = w - 1.0  # (llama.cpp's Gemma norms hold 1 + weight)
            if stem == "ffn_gate_inp_shexp":
                w = w.reshape(1, -1)  # (a vector in the file, a 1-row linear layer's weight)
            # F32 tensors come back as read-only views of the file's memory map: copy those.
            w = np.ascontiguousarray(w) if w.flags.writeable else w.copy()
            state[hf_name] = torch.from_numpy(w)
        if factors:
            cfg["rope_scaling"] = _longrope_scaling(reader, arch, factors)
        _stack_experts(state)
        chat_template = _field(reader, "tokenizer.chat_template")
        del reader
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{gguf_path} is not a valid GGUF file: {e}") from e

    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _save_tokenizer(gguf_path, out_dir, chat_template)


def _moe_config(
    reader: Any,
    arch: str,
    model_type: str,
    num_experts: int,
    cfg: dict[str, Any],
    names: set[str],
) -> dict[str, Any]:
    """A mixture of experts' keys of the Hugging Face config (``arch``: the file's, with
    ``model_type`` the config's): the experts, their size, whether the top k renormalize
    (llama.cpp's rule where the file does not say: Qwen3-MoE and Mixtral do, Qwen2-MoE does
    not), Qwen2-MoE's shared expert, and the layers without a router (dense)."""
    top_k = int(_field(reader, f"{arch}.expert_used_count", 0) or 0)
    if model_type == "mixtral":
        return {"num_local_experts": num_experts, "num_experts_per_tok": top_k}
    size = _field(reader, f"{arch}.expert_feed_forward_length")
    if size is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.expert_feed_forward_length")
    norm = _field(reader, f"{arch}.expert_weights_norm", model_type == "qwen3_moe")
    out: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(size),
        "norm_topk_prob": bool(norm),
        "mlp_only_layers": [
            i
            for i in range(cfg["num_hidden_layers"])
            if f"blk.{i}.ffn_gate_inp.weight" not in names
        ],
    }
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


def _stack_experts(state: dict[str, torch.Tensor]) -> None:
    """Each layer's stacked gate and up experts (``[E, I, H]`` each) as one ``gate_up_proj``
    ``[E, 2I, H]``, gate rows first (transformers' layout)."""
    for name in [n for n in state if n.endswith(".mlp.experts.gate_proj.weight")]:
        prefix = name.removesuffix("gate_proj.weight")
        up = state.pop(f"{prefix}up_proj.weight", None)
        if up is None:
            raise ModelLoadError(f"GGUF holds {name!r}'s experts' gate but not their up")
        state[f"{prefix}gate_up_proj"] = torch.cat([state.pop(name), up], dim=1)
    for name in [n for n in state if n.endswith(".mlp.experts.down_proj.weight")]:
        state[name.removesuffix(".weight")] = state.pop(name)
    if any(n.endswith(".mlp.experts.up_proj.weight") for n in state):
        raise ModelLoadError("GGUF holds experts' up projections without their gate")


def _gemma_config(reader: Any, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and 3's keys of the Hugging Face config: the activation, the query scale, the
    caps, the sliding layers (where the file names them) and the rope scaling."""
    out: dict[str, Any] = {"hidden_activation": "gelu_pytorch_tanh"}
    layers = cfg["num_hidden_layers"]
    big = layers == _GEMMA_27B_LAYERS[arch]
    heads = cfg["num_attention_heads"]
    out["query_pre_attn_scalar"] = cfg["hidden_size"] // heads if big else cfg["head_dim"]
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            out[key] = _f32(value)
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # (a flag a layer: it slides)
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:  # (one layer in `pattern` global, the last of each run)
        out["sliding_window_pattern"] = int(pattern)
    if str(_field(reader, f"{arch}.rope.scaling.type", "")) == "linear":
        factor = _f32(_field(reader, f"{arch}.rope.scaling.factor", 1.0))
        out["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return out


def _longrope_scaling(reader: Any, arch: str, factors: dict[str, list[float]]) -> dict[str, Any]:
    """Phi-3's ``rope_scaling`` (LongRoPE) from its factor tensors and rope metadata."""
    if set(factors) != {"long_factor", "short_factor"}:
        raise ModelLoadError(f"GGUF holds {sorted(factors)} of LongRoPE's two factor tensors")
    scaling: dict[str, Any] = {"rope_type": "longrope", **factors}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF metadata lacks {arch}.rope.scaling.original_context_length")
    scaling["original_max_position_embeddings"] = int(original)
    attention = _field(reader, f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = _f32(attention)
    return scaling


def _save_tokenizer(gguf_path: Path, out_dir: Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
        )
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from {gguf_path}: {e}") from e
    if chat_template is not None:
        tok.chat_template = chat_template
    tok.save_pretrained(str(out_dir))

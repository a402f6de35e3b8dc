"""Model and engine configuration. Engine flags keep vLLM's names."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from baton_engine.errors import InvalidRequestError, ModelLoadError
from baton_engine.json_args import json_object
from baton_engine.profiler import ProfilerConfig
from baton_engine.sampling_params import MAX_LOGPROBS

# vLLM's: "fcfs" serves requests in arrival order; "priority" by each request's priority (lower
# first), ties in arrival order.
SCHEDULING_POLICIES = ("fcfs", "priority")
# What sampled tokens' logprobs report (vLLM's --logprobs-mode; baton_engine.sampler): the
# log-probabilities of the model's own logits (the default) or those logits; or, "processed",
# the log-probabilities or logits a token is drawn from: after the banned, disallowed and
# grammar-forbidden tokens, the logit bias and the penalties, and for sampled rows the
# temperature, top-k, top-p and min-p (the tokens they cut at -inf). Prompt logprobs are always
# the model's own log-probabilities.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's --kv-cache-dtype values Baton serves (engine_core.resolve_kv_cache_dtype)
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's --quantization values Baton serves: fp8 (W8A8: baton_kernels.fp8_linear), and a
# quantized checkpoint's own method names, which vLLM takes for it (engine_core.use_fp8_linears)
QUANTIZATIONS = ("fp8", "compressed-tensors", "modelopt", "awq", "awq_marlin")
# vLLM's --runner: "generate" serves only generation, "pooling" only embeddings; "auto" (Baton's
# default) both, from any model.
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task and its --convert, as runners: a task "embed" (or "embedding") or a
# conversion "embed" makes a pooling engine, a task "generate" a generating one. A task
# "classify" or "score" (a conversion "classify") also pools, and needs a sequence-
# classification model (checked once the model's config is read: ``check_model_task``).
TASKS = {
    "auto": None,
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "classify": "pooling",
    "score": "pooling",
}
CONVERTS = {"auto": None, "none": None, "embed": "pooling", "classify": "pooling"}

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",  # (Phi-3, Phi-4: q/k/v and gate/up fused in the checkpoint)
    "GraniteForCausalLM": "granite",  # (Llama with the multipliers below)
    # Gemma: GeGLU MLP, RMSNorms scaling by (1 + weight), scaled embeddings; Gemma 2 and 3 add
    # norms on the attention's and the MLP's outputs and interleave sliding-window layers
    # (Gemma 2 caps scores and logits, Gemma 3 norms q and k and rotates its local layers by
    # their own rope).
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3 4B, 12B and 27B: the language model of a vision-language checkpoint, its vision
    # tower left out (prompts are text)
    "Gemma3ForConditionalGeneration": "gemma3",
    # Mixtures of experts: the decoders above with sparse MLPs (``models/moe.py``)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "GraniteMoeForCausalLM": "granitemoe",  # (with Granite's multipliers)
    # The same decoders with a classification head (``score``) on the last token's hidden
    # state instead of the LM head: classifiers, reward models and cross-encoders (rerankers).
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
}

if TYPE_CHECKING:
    import torch

# Accepted spellings -> torch attribute. Strings, so this module (and the command line that
# reads EngineConfig) imports without torch: the gateway has none.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return getattr(torch, _DTYPES[dtype.lower()])  # type: ignore[no-any-return]
    except KeyError:
        raise InvalidRequestError(
            f"unknown dtype {dtype!r}; choose one of {sorted(set(_DTYPES))}"
        ) from None


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from a Hugging Face ``config.json``."""

    # "llama" | "qwen2" | "qwen3" | "phi3" | "granite" | "gemma" | "gemma2" | "gemma3", and
    # mixtures of experts: "mixtral" | "qwen2_moe" | "qwen3_moe" | "granitemoe"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # The dimensions of each head the rotation turns (Phi-4-mini's 3/4: partial_rotary_factor);
    # 0: all of them. The others pass unturned (``rotary.partial_rotation_order``).
    rotary_dim: int = 0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # Embeddings may be cut to these sizes (Matryoshka training); None: not a Matryoshka
    # model, () any size (``is_matryoshka`` without a list), as vLLM reads them.
    matryoshka_dimensions: tuple[int, ...] | None = None
    # A sequence-classification model's labels, by class index (``id2label``): its head
    # (``lm_head``, read from the checkpoint's ``score``) has one output per label. Empty: a
    # causal LM.
    labels: tuple[str, ...] = ()
    # Granite's multipliers: of the embeddings, of each attention and MLP output added to the
    # residual stream, the attention's scale (None: 1/sqrt(head_dim)), the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Sliding-window attention (Mistral-7B-v0.1, Phi-3, Qwen2 with use_sliding_window, Gemma 2
    # and 3's local layers): a token attends to the last ``sliding_window`` positions only (its
    # own included), in the layers ``layer_types`` names "sliding_attention" (transformers'
    # list; empty: every layer). None: no window.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3: the sliding layers' rope theta (their rope unscaled); None: one rope for all
    local_rope_theta: float | None = None
    # The MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU, tanh-approximated)
    hidden_act: str = "silu"
    # Gemma: RMSNorm scales by (1 + weight); the offset is added to the weights at load
    norm_weight_offset: float = 0.0
    # Gemma 2 and 3: the attention's and the MLP's outputs are normed before each residual add
    sandwich_norms: bool = False
    # Gemma: the embedding multiplier is rounded to the model's dtype first, as transformers
    # rounds its normalizer (sqrt(hidden) is 34.0 in bf16 for Gemma 3 1B's 1152, not 33.94)
    embedding_multiplier_in_dtype: bool = False
    # Gemma 2: attention scores and final logits become c * tanh(x / c) (0: not capped)
    attn_logit_softcapping: float = 0.0
    final_logit_softcapping: float = 0.0
    # The language model of a vision-language checkpoint (its weights named under
    # ``language_model``; the vision tower's are not loaded)
    text_of_multimodal: bool = False
    # An FP8 checkpoint (``quantization_config``: transformers' "fp8", compressed-tensors'
    # float 8-bit, ModelOpt's FP8): its weights are dequantized on load to the model's dtype
    # (``model_loader.dequantized_fp8``); ``fp8_block``: the block of rows and columns one
    # scale covers (None: per tensor or per output channel).
    fp8_weights: bool = False
    fp8_block: tuple[int, int] | None = None
    # Integer weights, "compressed-tensors" (``weight_packed`` or int8 ``weight``, with
    # ``weight_scale`` and maybe ``weight_zero_point`` and ``weight_g_idx``) or "awq"
    # (AutoAWQ's GEMM layout: ``qweight``, ``qzeros``, ``scales``): kept packed or dequantized
    # on load to the model's dtype (``model_loader.dequantized_int``); ``int_group_size``: the
    # columns a scale covers, where the config names one size.
    int_weights: str = ""
    int_group_size: int | None = None
    # The bits of every quantized projection where they can stay packed (one layout for all,
    # none left unquantized, no activation order: ``int_linear.IntLinear``); 0 otherwise.
    int_bits: int = 0
    # A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): the MLP of its sparse layers
    # (``is_moe_layer``) is ``num_experts`` experts of ``moe_intermediate_size``, each token
    # routed to ``num_experts_per_tok`` of them (softmax, top k, renormalized if
    # ``norm_topk_prob``), plus a shared expert of ``shared_expert_intermediate_size`` under a
    # sigmoid gate (Qwen2-MoE). Its other layers have a dense MLP of ``intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sliding_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` is one of the sliding-window (local) layers."""
        if self.layer_types:
            return self.layer_types[layer] == "sliding_attention"
        return self.sliding_window is not None

    def layer_window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: its attention is full)."""
        window = self.sliding_window
        return window if window is not None and self.is_sliding_layer(layer) else 0

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is Llama's (SwiGLU MLP, two norms, no q/k norm, no experts): what
        the fused decode paths (GEMV layers, folded norms, the one-call CPU decode) compute."""
        return (
            self.hidden_act == "silu"
            and not self.sandwich_norms
            and not self.qk_norm
            and not self.is_moe
        )

    @property
    def gemv_layers(self) -> bool:
        """Whether every layer has Llama's two norms and SiLU, with or without q/k norms and
        experts: what ``DecoderLayer.forward_gemv`` computes."""
        return self.hidden_act == "silu" and not self.sandwich_norms

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is sparse (transformers' rule)."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def is_classifier(self) -> bool:
        return bool(self.labels)

    @property
    def num_outputs(self) -> int:
        """The width of the head's output: the vocabulary, or a classifier's labels."""
        return len(self.labels) or self.vocab_size

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = SUPPORTED_ARCHITECTURES.get(archs[0])
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs[0]!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        multimodal = archs[0] in _TEXT_CONFIG_DEFAULTS
        quant = _quant_fields(cfg.get("quantization_config"))
        if multimodal:
            cfg = _language_model_config(archs[0], cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        gemma: dict[str, Any] = {}
        if arch.startswith("gemma"):
            cfg, gemma = _gemma_fields(arch, cfg, hidden)
        # transformers >= 5 writes `rope_parameters` (theta and scaling together); older
        # configs have `rope_theta` and `rope_scaling`, which win where both are given (one
        # came from hf_overrides).
        scaling = dict(cfg.get("rope_scaling") or {})
        if "type" in scaling:  # (the older name)
            scaling.setdefault("rope_type", scaling.pop("type"))
        rope = dict(cfg.get("rope_parameters") or {}) | scaling
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        rotary_dim = int(head_dim * partial)  # (as transformers rounds it)
        if not 0 < partial <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {partial} turns {rotary_dim} of a head's {head_dim} "
                "dimensions: it needs an even number, at least 2"
            )
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "su":  # (LongRoPE's first name, in early Phi-3 configs)
            rope_type = rope["rope_type"] = "longrope"
        positions = int(cfg.get("max_position_embeddings", 2048))
        if rope_type in ("llama3", "yarn", "longrope"):  # (transformers' defaults; Phi-3's first)
            original = cfg.get("original_max_position_embeddings")
            rope["original_max_position_embeddings"] = int(
                original or rope.get("original_max_position_embeddings") or positions
            )
            if rope.get("factor") is None:
                rope["factor"] = positions / rope["original_max_position_embeddings"]
        eos = cfg.get("eos_token_id")
        eos_ids: tuple[int, ...] = (
            () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        )
        labels: tuple[str, ...] = ()
        if archs[0].endswith("ForSequenceClassification"):
            labels = _labels(cfg)
        num_layers = int(cfg["num_hidden_layers"])
        window, layer_types = _sliding_layers(arch, cfg, num_layers)
        moe: dict[str, Any] = {}
        if arch in ("mixtral", "qwen2_moe", "qwen3_moe", "granitemoe"):
            moe = _moe_fields(arch, cfg)
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope if rope_type != "default" else None,
            # (what the rope scaling serves, as vLLM derives it)
            max_position_embeddings=_rope_positions(
                positions, rope if rope_type != "default" else None
            ),
            # (a classifier has no LM head to tie, whatever its config says)
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)) and not labels,
            attention_bias=bool(
                cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("qwen2", "qwen2_moe")))
            ),
            qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            matryoshka_dimensions=(
                tuple(int(d) for d in cfg["matryoshka_dimensions"])
                if cfg.get("matryoshka_dimensions")
                else ()
                if cfg.get("is_matryoshka")
                else None
            ),
            labels=labels,
            sliding_window=window,
            layer_types=layer_types,
            hidden_act=_hidden_act(arch, cfg),
            embedding_multiplier=float(cfg.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_multiplier=(
                float(cfg["attention_multiplier"]) if cfg.get("attention_multiplier") else None
            ),
            logits_scaling=float(cfg.get("logits_scaling", 1.0)),
        )
        return cls(**(fields | moe | gemma | quant), text_of_multimodal=multimodal)

    @classmethod
    def from_path(cls, model_dir: Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
        """The model folder's config, with ``overrides`` (vLLM's ``hf_overrides``) replacing
        its top-level keys; as in vLLM, those of a sub-config (a vision-language checkpoint's
        ``text_config``) are replaced inside it."""
        path = model_dir / "config.json"
        try:
            cfg = json.loads(path.read_text())
            for key, value in (overrides or {}).items():
                if key.endswith("_config") and isinstance(value, dict):
                    value = dict(cfg.get(key) or {}) | value
                cfg[key] = value
            return cls.from_hf_dict(cfg)
        except FileNotFoundError:
            raise ModelLoadError(f"{model_dir} has no config.json") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"{path} is not a valid model config: {e}") from None


# A vision-language checkpoint's language model is described by its ``text_config``, whose
# keys left out take transformers' defaults for it (Gemma 3 4B's names 6 of them).
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": {  # (transformers' Gemma3TextConfig)
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}


def _language_model_config(architecture: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The config of a vision-language checkpoint's language model: its ``text_config`` over
    transformers' defaults, with the checkpoint's own token ids and dtype where it names them."""
    text = dict(cfg.get("text_config") or {})
    for key in ("bos_token_id", "eos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            text[key] = cfg[key]
    return _TEXT_CONFIG_DEFAULTS[architecture] | text


def _sliding_layers(
    arch: str, cfg: dict[str, Any], num_layers: int
) -> tuple[int | None, tuple[str, ...]]:
    """The sliding window (None: none is used) and each layer's kind (``layer_types``; empty:
    every layer slides when there is a window), by transformers' rules for configs that do not
    list them (Gemma 3's kinds also pick each layer's rope, window or not)."""
    window = cfg.get("sliding_window") or None
    types = tuple(str(t) for t in cfg.get("layer_types") or ())
    if not types and arch in ("gemma2", "gemma3"):
        # Gemma 2 alternates local and global layers; Gemma 3 has one global in 6
        every = 2 if arch == "gemma2" else int(cfg.get("sliding_window_pattern") or 6)
        types = tuple(
            "full_attention" if (i + 1) % every == 0 else "sliding_attention"
            for i in range(num_layers)
        )
    elif not types and window is not None and arch.startswith("qwen"):
        # Qwen's configs name a window their layers use only with use_sliding_window, from
        # layer max_window_layers on
        first = int(cfg.get("max_window_layers") or 28)
        types = tuple(
            "sliding_attention" if cfg.get("use_sliding_window") and i >= first
            else "full_attention"
            for i in range(num_layers)
        )  # fmt: skip
    if types and len(types) != num_layers:
        raise ValueError(f"layer_types lists {len(types)} layers, not {num_layers}")
    if types and "sliding_attention" not in types:
        window = None  # (every layer's attention is full)
    return (None if window is None else int(window)), types


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _quant_fields(quant: Any) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a checkpoint's ``quantization_config``: FP8 weights
    (transformers' "fp8", by blocks; compressed-tensors' float 8-bit, by tensor, channel or
    block; ModelOpt's FP8, by tensor) and compressed-tensors' integer weights (4 or 8 bits,
    packed or not, by tensor, channel or group, with or without zero points: llm-compressor's
    W4A16 / W8A16 / W8A8) and AutoAWQ's 4-bit GEMM layout are dequantized on load; any other
    method is refused by name."""
    if not quant:
        return {}
    if not isinstance(quant, dict):
        raise ModelLoadError(f"quantization_config must be an object: {quant!r}")
    method = str(quant.get("quant_method", "")).lower()
    block: Any = None
    if method == "fp8":
        block = quant.get("weight_block_size")
    elif method == "compressed-tensors":
        groups = list((quant.get("config_groups") or {}).values())
        weights = [g.get("weights") or {} for g in groups]
        kinds = {(w.get("type"), w.get("num_bits")) for w in weights}
        sparsity = (quant.get("sparsity_config") or {}).get("format", "dense")
        if sparsity != "dense":
            raise ModelLoadError(f"compressed-tensors sparsity {sparsity!r} is not supported")
        if groups and kinds <= {("int", 4), ("int", 8)}:
            sizes = sorted({int(w["group_size"]) for w in weights if w.get("group_size")})
            size = sizes[0] if len(sizes) == 1 else None
            # one layout for every layer (kept packed: IntLinear), unless some projection is
            # left unquantized or columns are grouped out of order (weight_g_idx)
            layouts = {(w.get("num_bits"), w.get("strategy"), w.get("group_size")) for w in weights}
            ignored = any("proj" in str(name) for name in quant.get("ignore") or ())
            act_order = any(str(w.get("actorder")).lower() == "group" for w in weights)
            uniform = len(layouts) == 1 and not ignored and not act_order
            return {
                "int_weights": "compressed-tensors",
                "int_group_size": size,
                "int_bits": int(weights[0]["num_bits"]) if uniform else 0,
            }
        if not groups or kinds != {("float", 8)}:
            raise ModelLoadError(
                f"compressed-tensors weights {sorted(map(str, kinds))} are not supported "
                "(float 8-bit: FP8, or integers of 4 or 8 bits)"
            )
        blocks = {tuple(w.get("block_structure") or ()) for w in weights}
        block = next(iter(blocks)) or None if len(blocks) == 1 else "several"
    elif method == "awq":
        bits, version = quant.get("bits") or quant.get("w_bit") or 4, quant.get("version", "gemm")
        if int(bits) != 4 or str(version).lower() != "gemm":
            raise ModelLoadError(
                f"AWQ checkpoints of {bits} bits, version {version!r}, are not supported "
                "(4-bit, GEMM)"
            )
        size = int(quant.get("group_size") or quant.get("q_group_size") or -1)
        ignored = any("proj" in str(name) for name in quant.get("modules_to_not_convert") or ())
        return {
            "int_weights": "awq",
            "int_group_size": size if size > 0 else None,
            "int_bits": 0 if ignored else 4,
        }
    elif not (method == "modelopt" and str(quant.get("quant_algo", "")).upper() == "FP8"):
        raise ModelLoadError(
            f"quantization method {method or quant!r} is not supported: Baton serves "
            "unquantized weights, FP8 checkpoints (fp8, compressed-tensors FP8, ModelOpt FP8), "
            "compressed-tensors' 4- and 8-bit integer weights and AWQ's, which it dequantizes "
            "on load"
        )
    if block is not None and (
        not isinstance(block, list | tuple) or len(block) != 2 or min(map(int, block)) < 1
    ):
        raise ModelLoadError(f"FP8 weight blocks {block!r} are not supported (two sizes)")
    return {"fp8_weights": True, "fp8_block": tuple(int(b) for b in block) if block else None}


def _hidden_act(arch: str, cfg: dict[str, Any]) -> str:
    """The MLP's activation (Gemma's configs call it hidden_activation; transformers runs Gemma
    1's legacy "gelu" as the tanh approximation)."""
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if arch == "gemma" and name == "gelu":
        return "gelu_tanh"
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"hidden activation {name!r} is not supported (supported: {sorted(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]


def _gemma_fields(
    arch: str, cfg: dict[str, Any], hidden: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Gemma config made readable by the generic parsing (Gemma 3's rope of its global
    layers as the model's rope), and the ``ModelConfig`` fields that are Gemma's."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")
    fields: dict[str, Any] = dict(
        norm_weight_offset=1.0,
        embedding_multiplier=hidden**0.5,
        embedding_multiplier_in_dtype=True,
    )
    if arch == "gemma":
        return cfg, fields
    fields["sandwich_norms"] = True
    fields["attention_multiplier"] = float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5
    fields["attn_logit_softcapping"] = float(cfg.get("attn_logit_softcapping") or 0.0)
    fields["final_logit_softcapping"] = float(cfg.get("final_logit_softcapping") or 0.0)
    if arch == "gemma3":
        rope = cfg.get("rope_parameters") or {}
        if "full_attention" in rope:  # (transformers >= 5: a rope for each kind of layer)
            local = dict(rope.get("sliding_attention") or {})
            cfg = cfg | {"rope_parameters": rope["full_attention"]}
        else:
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
        if local.get("rope_type", "default") != "default":
            raise ValueError("a scaled rope on Gemma 3's local layers is not supported")
        fields["local_rope_theta"] = float(local.get("rope_theta") or 10000.0)
        if not (cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")):
            cfg = cfg | {"rope_theta": 1_000_000.0}  # (transformers' default for its global layers)
    return cfg, fields


def _rope_positions(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions a model serves with its rope scaling, as vLLM derives them: ``linear``
    and ``yarn`` stretch the (original) positions by their factor; ``llama3``'s config already
    counts them."""
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if scaling is None or rope_type not in ("linear", "yarn"):
        return max_position_embeddings
    base = max_position_embeddings
    if rope_type == "yarn":
        base = int(scaling.get("original_max_position_embeddings") or base)
    return int(base * float(scaling["factor"]))


def _moe_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' ``ModelConfig`` fields from its config (Mixtral's and
    Granite-MoE's experts have the ``intermediate_size`` and always renormalize their top k;
    transformers >= 5 writes ``num_local_experts`` for Qwen3-MoE too)."""
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if num_experts <= 0 or not 0 < top_k <= num_experts:
        raise ValueError(
            f"a mixture of experts needs 0 < num_experts_per_tok ({top_k}) <= the number of "
            f"experts ({num_experts})"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    if arch in ("mixtral", "granitemoe"):
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True,
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # (transformers' default)
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        decoder_sparse_step=max(1, int(cfg.get("decoder_sparse_step") or 1)),
        mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
    )


def _labels(cfg: dict[str, Any]) -> tuple[str, ...]:
    """A sequence-classification config's labels in class order: ``id2label``, sized by
    ``num_labels`` (transformers' default: 2), named ``LABEL_i`` where it has no name."""
    id2label = {int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()}
    num_labels = int(cfg.get("num_labels") or len(id2label) or 2)
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(num_labels))


# vLLM's --speculative-config methods that need heads or layers trained for them (Baton runs
# n-gram lookup and a separate draft model)
_HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "deepseek_mtp",
                 "ernie_mtp", "qwen3_next_mtp", "suffix")  # fmt: skip
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
# Keys of vLLM's speculative config that Baton reads; others are refused, naming them.
_SPECULATIVE_KEYS = (
    "method",
    "model",
    "num_speculative_tokens",
    *_NGRAM_KEYS,
    "disable_by_batch_size",
    "draft_tensor_parallel_size",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``--speculative-config``): each step, a decoding request
    takes up to ``num_speculative_tokens`` draft tokens after its last one, and one forward
    pass checks them all: the tokens the model agrees with are kept, and one more is sampled
    after them. Greedy requests get exactly their tokens without speculation; sampled ones are
    drawn from exactly their distribution (rejection sampling). No draft is proposed while
    ``disable_by_batch_size`` or more requests run. The drafts come from

    - ``method="ngram"`` (prompt lookup): a request whose last ``n`` tokens
      (``prompt_lookup_min`` <= n <= ``prompt_lookup_max``, the longest that matches) occurred
      before in its prompt or output proposes the tokens that followed them;
    - ``method="draft_model"`` (``model``: a smaller model of the same vocabulary): the draft
      model's greedy tokens after the request's tokens (``runner.draft``)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = None
    method: str = "ngram"
    model: str | None = None  # the draft model (method "draft_model")
    # its split (None: the model's tensor_parallel_size, the only one it runs with)
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's JSON object (or a dict offline); None stays None. ``InvalidRequestError``
        for a method Baton does not run, an unknown key or a bad value."""
        if value is None or (isinstance(value, str) and not value.strip()):
            return None
        value = json_object("speculative_config", value, _SPECULATIVE_KEYS)
        method, model = value.get("method"), value.get("model")
        if method is None and model in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older form: {"model": "[ngram]"}
        elif method is None and model is not None:
            method = "draft_model"  # (vLLM infers it from a model that is no EAGLE or MTP head)
        if method == "[ngram]":
            method = "ngram"
        if method == "ngram" and model not in (None, "ngram", "[ngram]"):
            raise InvalidRequestError("speculative_config: method 'ngram' takes no model")
        if method not in ("ngram", "draft_model"):
            what = "no method" if method is None else f"method {method!r}"
            raise InvalidRequestError(
                f"speculative_config: {what} is not supported; Baton speculates by n-gram "
                'lookup, {"method": "ngram", "num_speculative_tokens": K}, or with a draft '
                'model, {"model": PATH, "num_speculative_tokens": K}'
                + (" (EAGLE, Medusa and MTP heads are not run)" if method in _HEAD_METHODS else "")
            )
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise InvalidRequestError(
                    "speculative_config: method 'draft_model' needs a model (a path)"
                )
            ngram_keys = sorted(set(_NGRAM_KEYS) & set(value))
            if ngram_keys:
                raise InvalidRequestError(
                    f"speculative_config: {ngram_keys} apply to method 'ngram' only"
                )
            draft_tp = value.get("draft_tensor_parallel_size")
            if draft_tp is not None and (
                isinstance(draft_tp, bool) or not isinstance(draft_tp, int) or draft_tp < 1
            ):
                raise InvalidRequestError(
                    "speculative_config: draft_tensor_parallel_size must be a whole number of "
                    f"at least 1, got {draft_tp!r}"
                )
        elif "draft_tensor_parallel_size" in value:
            raise InvalidRequestError(
                "speculative_config: draft_tensor_parallel_size applies to a draft model only"
            )
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = 5  # vLLM's defaults
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        by_batch = value.get("disable_by_batch_size")
        for name, number in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_min", lo),
            ("prompt_lookup_max", hi),
            ("disable_by_batch_size", by_batch if by_batch is not None else 1),
        ):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise InvalidRequestError(
                    f"speculative_config: {name} must be a whole number of at least 1, "
                    f"got {number!r}"
                )
        assert isinstance(lo, int) and isinstance(hi, int) and isinstance(k, int)
        if lo > hi:
            raise InvalidRequestError(
                f"speculative_config: prompt_lookup_min ({lo}) is above prompt_lookup_max ({hi})"
            )
        if method != "draft_model":
            return cls(k, lo, hi, by_batch, method)
        return cls(k, lo, hi, by_batch, method, model, value.get("draft_tensor_parallel_size"))


def large_gpu(total_memory: int, name: str) -> bool:
    """A GPU of at least 70 GiB that is not an A100: vLLM's test for its larger defaults (an
    A100 lost throughput with them, vLLM PR #17885)."""
    return total_memory >= 70 * (1 << 30) and "a100" not in name.lower()


def _large_gpu(device: str) -> bool:
    if not device.startswith("cuda"):
        return False
    import torch

    if not torch.cuda.is_available():
        return False
    props = torch.cuda.get_device_properties(torch.device(device))
    return large_gpu(props.total_memory, props.name)


@dataclass
class EngineConfig:
    """Engine knobs, named as vLLM names them."""

    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct GGUF)
    # vLLM's --tokenizer: a folder (or GGUF) whose tokenizer to use instead of the model's
    tokenizer: str | None = None
    max_model_len: int | None = None  # None: min(model's max positions, 8192)
    max_num_seqs: int = 256
    # None: by usage. Offline, a large budget gives the fewest, fullest steps; serving on CPU, a
    # small one lets new prompts in every step instead of in one long prefill step per wave
    # (halved mean TTFT at equal throughput, benchmarks/RESULTS.md).
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0  # 0: a prompt may take the whole step budget
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_kv_events: bool = False  # record block stored/removed events (for the kvstore)
    dtype: str = "auto"  # "auto": bfloat16 for the model's 16-bit dtypes (float32 on CPUs
    # without AVX512, where bf16 matmuls are slow), else its dtype
    # vLLM's --kv-cache-dtype: "auto" (the model's dtype) | "fp8" / "fp8_e4m3" | "fp8_e5m2"
    # (K/V stored as 8-bit floats, divided by an FP8 checkpoint's scales, else by 1: twice
    # the tokens in the same memory) |
    # "bfloat16" (a bfloat16 model's: as "auto")
    kv_cache_dtype: str = "auto"
    # vLLM's --quantization: None (a checkpoint's own: an FP8 checkpoint's FP8 layers on GPUs
    # with FP8 GEMMs, else its weights dequantized) | "fp8" (the projections' weights FP8, a
    # scale an output channel, quantized on load unless the checkpoint's are; activations
    # quantized per token: baton_kernels.fp8_linear)
    quantization: str | None = None
    kv_cache_memory: int | None = None  # bytes for the KV pool on CPU; None: 1 GiB
    num_gpu_blocks_override: int | None = None  # exact number of KV blocks (tests)
    # vLLM's --kv-offloading-size: GiB of host memory (pinned on GPUs) for a second tier of the
    # prefix cache, summed over tensor-parallel ranks: blocks the pool evicts are kept there
    # and copied back on a later hit (kv_cache.host_cache); None or 0: no tier
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"  # vLLM's; only its "native" (Baton's own tier)
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"  # "auto" | "dummy"
    attention_backend: str = "auto"  # "auto" | "cpu" | "triton" | "torch" (reference) | ...
    enforce_eager: bool = False  # GPU: no CUDA graphs (decode steps, prompt-step pieces)
    # vLLM's sleep mode: an idle engine may give its device memory back (EngineCore.sleep)
    enable_sleep_mode: bool = False
    # vLLM's: the sliding-window layers attend fully, and sequences are served up to the window
    disable_sliding_window: bool = False
    # vLLM's: prompts may come as input embeddings (prompt_embeds) instead of tokens
    enable_prompt_embeds: bool = False
    # Schedule and launch step N+1 while step N runs on the device (its sampled tokens reach
    # the host one step later). None: on for GPUs, where it hides the host's per-step work;
    # off on CPUs, where the forward pass itself runs on the host.
    async_scheduling: bool | None = None
    # Multi-step scheduling (vLLM V0's flag): a step whose requests are all plain decodes (no
    # prompt waiting for room, no logprobs, penalties or stop strings) runs up to this many
    # forward passes, so the host's per-step work (scheduling, inputs, outputs) is paid once
    # for them; tokens then reach the caller that many at a time.
    num_scheduler_steps: int = 1
    scheduling_policy: str = "fcfs"  # one of SCHEDULING_POLICIES
    runner: str = "auto"  # one of RUNNERS
    task: str = "auto"  # vLLM's older --task, one of TASKS (sets the runner)
    convert: str = "auto"  # vLLM's --convert, one of CONVERTS (sets the runner)
    # How embeddings pool (vLLM's --pooler-config JSON: {"pooling_type": "LAST" | "MEAN" |
    # "CLS", "normalize": bool}); None: the model folder's sentence-transformers config, LAST
    pooler_config: str | None = None
    # Keys of the model's config.json replaced (vLLM's --hf-overrides, a JSON object, or a dict
    # offline): {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, ...}} serves Qwen2.5 at
    # 128k tokens without editing its folder.
    hf_overrides: str | dict[str, Any] | None = None
    seed: int = 0
    device: str = "cpu"
    # Split the model's heads and MLP across this many processes (ranks 1..N-1 are helper
    # processes of the engine): NCCL on GPUs, one GPU each; gloo on CPUs.
    tensor_parallel_size: int = 1
    # LoRA adapters (vLLM's flags): requests may name an adapter (``LoRARequest``); a step runs
    # at most ``max_loras`` of them, each of rank <= ``max_lora_rank``; ``max_cpu_loras``
    # adapters stay read on the host (None: ``max_loras``). ``lora_modules``: adapters known by
    # name from the start, each ``name=path`` or vLLM's JSON form (``{"name": ..., "path":
    # ...}``): what a worker serves under those names.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[str, ...] = ()
    usage_context: str = "offline"  # "offline" | "serving": picks defaults, as in vLLM
    # The most logprobs (and prompt logprobs) per token a request may ask for (vLLM's; -1: as
    # many as Baton returns, MAX_LOGPROBS)
    max_logprobs: int = MAX_LOGPROBS
    # What sampled tokens' logprobs report (vLLM's --logprobs-mode: LOGPROBS_MODES)
    logprobs_mode: str = "raw_logprobs"
    # vLLM's --calculate-kv-scales: an 8-bit KV cache's scales calculated from a pass of the
    # model at start-up (ModelRunner.calculate_kv_scales) instead of the checkpoint's (or 1);
    # changes nothing with a 16-bit cache
    calculate_kv_scales: bool = False
    # vLLM's --logits-processors: custom logits processors, each a class (offline) or its name
    # (package.module.Class or package.module:Class), subclasses of
    # baton_engine.logits_processor.LogitsProcessor, run on every step's logits
    logits_processors: tuple[str | type, ...] = ()
    # vLLM's --speculative-config (a JSON object, or a dict offline): n-gram speculative
    # decoding (SpeculativeConfig); None: off
    speculative_config: str | dict[str, Any] | None = None
    # vLLM's --profiler-config (a JSON object, or a dict offline): {"profiler": "torch",
    # "torch_profiler_dir": DIR, ...} records the steps between start_profile and stop_profile
    # (baton_engine.profiler); None: $VLLM_TORCH_PROFILER_DIR's folder if set, else off
    profiler_config: str | dict[str, Any] | None = None

    def resolved_async_scheduling(self) -> bool:
        """As asked; by default on for GPUs, off for CPUs. With speculative decoding too: a
        request whose last token is still on the device drafts after a guess of it, and a step
        with drafts is not run ahead of (on an H100, Qwen2.5-0.5B's shape at batch 1 with n-gram
        drafts ran 1,127-1,243 tok/s so, against 939-1,009 without async scheduling; at batch 8,
        where wrong guesses cost their drafts, 3,710-3,924 against 4,431-4,595)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        spec = self.speculative()
        if spec is not None and spec.model is not None:
            return False  # (a draft model's drafts follow the step's tokens: see validate)
        return self.device.startswith("cuda")

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def profiler(self) -> ProfilerConfig:
        return ProfilerConfig.parse(self.profiler_config)

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.usage_context == "serving":
            return 512 if self.device == "cpu" else 2048
        # As vLLM's offline LLM: 16,384 on GPUs of >= 70 GiB but the A100 (on an H200 the
        # Qwen2.5-0.5B workload of issue 5 at 256 ran 2% faster than with 8,192,
        # benchmarks/device/ab_budget.sh), else 8,192.
        return 16384 if _large_gpu(self.device) else 8192

    def hf_overrides_dict(self) -> dict[str, Any]:
        """``hf_overrides`` as a dict (``InvalidRequestError`` unless a JSON object)."""
        return {} if self.hf_overrides is None else json_object("hf_overrides", self.hf_overrides)

    def _check_draft_model(self) -> None:
        """What a draft model (``speculative_config``'s ``model``) does not run with: its
        drafts are proposed once a step's tokens are known, so no step runs ahead of them.
        Under tensor parallelism it is split as the model is (vLLM's
        ``draft_tensor_parallel_size`` equal to the model's)."""
        if self.async_scheduling:
            raise InvalidRequestError(
                "a draft model (speculative_config) does not run with async scheduling: its "
                "drafts follow each step's sampled tokens (leave async_scheduling unset)"
            )
        if self.runner == "pooling":
            raise InvalidRequestError("a draft model (speculative_config) serves generation only")
        spec = self.speculative()
        draft_tp = spec.draft_tensor_parallel_size if spec is not None else None
        if draft_tp not in (None, self.tensor_parallel_size):
            raise InvalidRequestError(
                f"speculative_config: draft_tensor_parallel_size {draft_tp} is not supported: "
                f"the draft model is split as the model is ({self.tensor_parallel_size} ways; "
                "leave it unset)"
            )

    def _runner_from_task(self) -> None:
        """Set ``runner`` from vLLM's ``task`` / ``convert`` (``InvalidRequestError`` for a
        value Baton does not serve, or one that contradicts ``runner``)."""
        for name, table in (("task", TASKS), ("convert", CONVERTS)):
            value = getattr(self, name)
            if value not in table:
                raise InvalidRequestError(
                    f"{name} {value!r} is not supported (supported: {', '.join(table)}; "
                    "Baton serves generation, embeddings and sequence classification)"
                )
            wanted = table[value]
            if wanted is None:
                continue
            if self.runner not in ("auto", wanted):
                raise InvalidRequestError(
                    f"{name} {value!r} needs runner {wanted!r}, but runner is {self.runner!r}"
                )
            self.runner = wanted

    def check_model_task(self, model: ModelConfig) -> None:
        """Once the model's config is read: a sequence-classification model only classifies
        (``runner`` becomes "pooling"; "generate", or a task or conversion "embed", is an
        error), and a task "classify" / "score" or a conversion "classify" needs one."""
        embed = self.task in ("embed", "embedding") or self.convert == "embed"
        classify = self.task in ("classify", "score") or self.convert == "classify"
        if model.is_classifier:
            if self.runner == "generate" or embed:
                raise InvalidRequestError(
                    "this is a sequence-classification model: it classifies (and scores "
                    "pairs), it does not generate or embed (leave --runner, --task and "
                    "--convert unset, or use --task classify)"
                )
            self.runner = "pooling"
        elif classify:
            raise InvalidRequestError(
                "--task classify / score and --convert classify need a sequence-classification "
                "model (an architecture *ForSequenceClassification); this one is a causal LM"
            )

    def validate(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "tensor_parallel_size",
            "num_scheduler_steps",
            "max_loras",
            "max_lora_rank",
            "max_cpu_loras",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidRequestError(f"{name} must be at least 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise InvalidRequestError("max_model_len must be at least 1")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise InvalidRequestError(
                f"quantization {self.quantization!r} is not supported: Baton serves fp8 (FP8 "
                "weights, a scale an output channel, activations quantized per token), "
                "unquantized weights (a GGUF's are dequantized on load) and a quantized "
                f"checkpoint's own method ({', '.join(QUANTIZATIONS[1:])})"
            )
        if self.kv_offloading_size is not None and self.kv_offloading_size < 0:
            raise InvalidRequestError("kv_offloading_size must be at least 0 (GiB)")
        if self.kv_offloading_backend != "native":
            raise InvalidRequestError(
                f"kv_offloading_backend {self.kv_offloading_backend!r} is not supported: "
                "Baton keeps offloaded KV blocks in its own host tier ('native')"
            )
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise InvalidRequestError(
                "kv_offloading_size needs prefix caching: the host tier keeps the blocks the "
                "prefix cache evicts"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported (supported: "
                f"{', '.join(KV_CACHE_DTYPES)})"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        if not -1 <= self.max_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"max_logprobs must be in [-1, {MAX_LOGPROBS}] (Baton returns at most "
                f"{MAX_LOGPROBS} logprobs per token), got {self.max_logprobs}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(
                f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, "
                f"got {self.logprobs_mode!r}"
            )
        if self.lora_modules and not self.enable_lora:
            raise InvalidRequestError("lora_modules (--lora-modules) needs enable_lora")
        if self.runner not in RUNNERS:
            raise InvalidRequestError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        self._runner_from_task()
        if self.pooler_config is not None:
            from baton_engine.pooling_params import PoolerConfig

            PoolerConfig.resolve(self.pooler_config, None)  # (its errors, before the model)
        self.hf_overrides_dict()  # (its errors, before the model)
        if self.profiler().profiler == "cuda" and not self.device.startswith("cuda"):
            raise InvalidRequestError("profiler 'cuda' needs a GPU (device is a CPU)")
        if self.speculative() is not None and self.num_scheduler_steps > 1:
            raise InvalidRequestError(
                "speculative decoding and multi-step scheduling (num_scheduler_steps > 1) "
                "cannot be combined"
            )
        spec = self.speculative()
        if spec is not None and spec.model is not None:
            self._check_draft_model()
        if self.logits_processors and (spec is not None or self.num_scheduler_steps > 1):
            raise InvalidRequestError(  # (vLLM refuses speculative decoding with them too)
                "custom logits processors (logits_processors) run with neither speculative "
                "decoding nor multi-step scheduling (num_scheduler_steps > 1)"
            )
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError(
                f"load_format must be 'auto' or 'dummy', got {self.load_format!r}"
            )

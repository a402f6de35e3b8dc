"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm, SmolLM,
Phi-3 with its projections fused in the checkpoint, Granite with its multipliers, Gemma 1-3
with their GeGLU, (1 + weight) norms, sandwich norms, local layers and softcaps), and its
mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite-MoE: ``moe.SparseMoE`` in place of
the MLP).

Q/K/V and gate/up projections are fused into one matmul each (fewer, larger GEMMs); Hugging Face
checkpoints are split into them at load time. Layers pass ``(hidden, residual)`` along, so that
each residual add and the RMSNorm after it can be one kernel; ``use_fused_kernels()`` (GPU)
switches the residual add + norm, the rotary embedding and SiLU-and-multiply to fused kernels
(``baton_kernels.fused``: Triton on GPUs, C++ on CPUs), each replacing a chain of small torch
kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.config import ModelConfig
from baton_engine.models.moe import SparseMoE
from baton_engine.models.rotary import (
    FusedRope,
    RopeTables,
    RotaryEmbedding,
    partial_rotation_order,
    reorder_heads,
)
from baton_kernels import fused
from baton_kernels.attention import AttentionBackend, AttentionMetadata, KVCacheView
from baton_kernels.cpu_linear import PackedLinear
from baton_kernels.fp8_linear import FP8_DTYPE, Fp8Linear
from baton_kernels.int_linear import IntLinear, span_cols

if TYPE_CHECKING:
    from baton_kernels.triton.decode_attention import DecodeNorm


class RMSNorm(nn.Module):
    fused = False  # Triton kernels (set by use_fused_kernels)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel accumulates in float32 for 16-bit inputs, as HF's RMSNorm does.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual += x`` (``x`` alone for the first layer), then the norm of the sum:
        ``(normed, residual)``."""
        if self.fused:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self(x), x
        residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_multiplier or self.head_dim**-0.5
        self.window = cfg.layer_window(index)  # 0: full attention
        self.softcap = cfg.attn_logit_softcapping
        # which of the model's ropes rotates this layer (Gemma 3's local layers: the second)
        self.rope_index = int(cfg.local_rope_theta is not None and cfg.is_sliding_layer(index))
        # an 8-bit KV cache's scales of K and V (an FP8 checkpoint's calibrated ones, else 1)
        self.k_scale = self.v_scale = 1.0

    def attend(
        self,
        rope: RopeTables | FusedRope,
        qkv: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        norm: DecodeNorm | None = None,
    ) -> torch.Tensor:
        """Attention of the projected ``qkv`` ``[T, q + 2 kv]``: ``[T, q]``, before o_proj.
        ``norm``: ``qkv`` is a folded projection's, normed in the decode kernel
        (``DecoderLayer.forward_folded``)."""
        num_tokens = qkv.shape[0]
        q, k, v = torch.split(qkv, [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            if self.q_norm.fused and q.is_cuda:  # one launch, in place (no copies of q, k)
                from baton_kernels.triton.fused_ops import head_rms_norm_

                head_rms_norm_(q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        if isinstance(rope, FusedRope) and getattr(backend, "fuses_rope", False):
            # rotation and cache write in one launch (TritonAttentionBackend.forward_rope)
            out = backend.forward_rope(  # type: ignore[attr-defined]
                q, k, v, kv_cache, metadata, self.scale, rope.positions, rope.cos_sin, norm,
                window=self.window, softcap=self.softcap,
            )  # fmt: skip
        else:
            assert norm is None, "a folded norm needs the backend's forward_rope"
            q, k = rope.apply_qk(q, k)
            out = backend.forward(
                q, k, v, kv_cache, metadata, self.scale, window=self.window, softcap=self.softcap
            )
        return cast(torch.Tensor, out).reshape(num_tokens, self.q_size)


class MLP(nn.Module):
    fused = False  # fused SiLU- (GELU-) and-multiply kernels (set by use_fused_kernels)

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = self.intermediate_size = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_tanh"  # Gemma's GeGLU (else SwiGLU)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused:
            act_and_mul = fused.gelu_tanh_and_mul if self.gelu else fused.silu_and_mul
            return self.down_proj(act_and_mul(gate_up))  # type: ignore[no-any-return]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)  # type: ignore[no-any-return]


def _no_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


class DecoderLayer(nn.Module):
    # Tensor parallelism: sums the partial outputs of the row-parallel o_proj and down_proj
    # across the ranks (an all-reduce); the identity on one rank.
    reduce: Callable[[torch.Tensor], torch.Tensor] = staticmethod(_no_reduce)
    gemv_mlp = True  # forward_gemv runs the MLP as GEMVs too (use_gemv_decode)
    gemv_down = False  # without gemv_mlp, folded: the down projection as a GEMV (use_gemv_decode)
    folded_norms = False  # the norms' weights are in the projections (fold_norms)

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, index)
        # the norm before the MLP (Gemma 2/3's pre_feedforward_layernorm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Gemma 2/3: norms of the attention's and the MLP's outputs (their post_attention_ and
        # post_feedforward_layernorm), before each is added to the residual stream
        self.attn_output_norm: RMSNorm | None = None
        self.mlp_output_norm: RMSNorm | None = None
        if cfg.sandwich_norms:
            self.attn_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.mlp_output_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | SparseMoE
        if cfg.is_moe_layer(index):
            shared = cfg.shared_expert_intermediate_size
            self.mlp = SparseMoE(cfg, MLP(cfg, shared) if shared else None)
        else:
            self.mlp = MLP(cfg)

    @property
    def dense_mlp(self) -> MLP:
        """The MLP, on a path that fuses its pieces: never a mixture of experts' (the model
        turns those paths off for one)."""
        assert isinstance(self.mlp, MLP), "a mixture of experts runs the generic path"
        return self.mlp

    def pre_attention(
        self, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to attention (which reads the step's metadata): ``hidden`` is the
        previous layer's output not yet added to ``residual`` (None for the first layer, whose
        input is the residual stream itself). Returns ``(qkv, residual)``."""
        hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        return self.self_attn.qkv_proj(hidden), residual

    def post_attention(
        self, out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention (``out`` ``[T, q]``): ``(mlp output, residual)``."""
        hidden = self.reduce(self.self_attn.o_proj(out))
        if self.attn_output_norm is not None:
            hidden = self.attn_output_norm(hidden)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        hidden = self.reduce(self.mlp(hidden))
        if self.mlp_output_norm is not None:
            hidden = self.mlp_output_norm(hidden)
        return hidden, residual

    def forward_gemv(
        self,
        rope: RopeTables | FusedRope,
        stream: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The layer for a few rows (``LlamaForCausalLM.use_gemv_decode``), in 5 launches: each
        norm runs inside the projection after it, SiLU-and-multiply inside the down
        projection, and the residual adds inside o_proj and down_proj, which update
        ``stream`` (the residual stream, normed by neither) in place.

        A mixture of experts' layer runs its attention's projections as GEMVs, then the norm
        and the experts' own kernels (``SparseMoE.add_rows``: the router a GEMV too), whose
        last adds their output to ``stream``.

        With ``gemv_mlp`` off only the attention's projections are GEMVs; the MLP's long
        reads stay with cuBLAS: its norm and SiLU-and-multiply run as their own kernels, and
        down_proj adds into ``stream`` in its GEMM (``addmm_``), 7 launches a layer (6 with the
        norms folded, ``fold_norms``: SiLU-and-multiply applies the norm; 5 with ``gemv_down``
        too: the down projection is a GEMV that applies the norm and SiLU-and-multiply, and
        returns a new stream; gate_up too is a GEMV where ``gemv.dot_launch`` has a launch for
        it, on the tensor cores, as for Llama-3.1-8B's bf16 weights). (The attention is one
        launch: on these decode-only steps the Triton decode kernel rotates q and writes the
        new K/V itself.)"""
        from baton_kernels.triton.gemv import dot_launch, gemv

        attn = self.self_attn
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv = gemv(
            stream,
            attn.qkv_proj.weight,
            attn.qkv_proj.bias,
            norm_weight=norm1.weight,
            eps=norm1.eps,
        )
        out = attn.attend(rope, qkv, kv_cache, metadata, backend)
        gemv(out, attn.o_proj.weight, residual=stream, out=stream)
        if isinstance(self.mlp, SparseMoE):  # (the experts' kernels, after a norm of its own)
            return self.mlp.add_rows(norm2.add_forward(stream, None)[0], stream)
        mlp = self.dense_mlp
        if not self.gemv_mlp:
            if self.folded_norms and self.gemv_down:
                # SiLU-and-multiply, with the folded norm's 1/rms, inside the down projection,
                # which reads the stream while it adds into it: its output is a new tensor
                w = mlp.gate_up_proj.weight
                # cuBLAS, unless the tensor-core GEMV has a launch for the shape
                gate_up = gemv(stream, w) if dot_launch(w) else F.linear(stream, w)
                return gemv(gate_up, mlp.down_proj.weight, silu_mul=True, norm_of=stream,
                            eps=norm2.eps, residual=stream)  # fmt: skip
            if self.folded_norms:
                return self.folded_mlp(stream)
            act = fused.silu_and_mul(mlp.gate_up_proj(norm2.add_forward(stream, None)[0]))
            return stream.addmm_(act, mlp.down_proj.weight.t())
        gate_up = gemv(stream, mlp.gate_up_proj.weight, norm_weight=norm2.weight, eps=norm2.eps)
        gemv(gate_up, mlp.down_proj.weight, silu_mul=True, residual=stream, out=stream)
        return stream

    def forward_folded(
        self,
        rope: RopeTables | FusedRope,
        stream: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        """The layer on a decode-only step once its norms are folded into the projections
        after them (``LlamaForCausalLM.fold_norms``), in 6 launches instead of 8: the qkv
        projection reads the residual stream itself and the decode kernel applies the norm's
        1/rms and the bias to q, k and v (``DecodeNorm``); o_proj and down_proj add into
        ``stream`` in their GEMMs (``addmm_``); SiLU-and-multiply applies the second norm's
        1/rms to gate and up. Returns ``stream``, updated in place."""
        attn = self.self_attn
        qkv = F.linear(stream, attn.qkv_proj.weight)
        out = attn.attend(rope, qkv, kv_cache, metadata, backend, self.folded_norm(stream))
        stream.addmm_(out, attn.o_proj.weight.t())
        return self.folded_mlp(stream)

    def folded_norm(self, stream: torch.Tensor) -> DecodeNorm:
        """The input norm of a folded layer, for the attention backend to apply to the qkv
        projection of ``stream`` (one row a token) with the projection's bias."""
        from baton_kernels.triton.decode_attention import DecodeNorm

        attn = self.self_attn
        bias = attn.qkv_proj.bias
        return DecodeNorm(
            stream,
            self.input_layernorm.eps,
            None if bias is None else bias.view(-1, attn.head_dim),
        )

    def folded_mlp(self, stream: torch.Tensor) -> torch.Tensor:
        """The MLP of a folded layer (``forward_folded``) added into ``stream`` in place: the
        gate/up GEMM on the stream itself, SiLU-and-multiply applying the norm's 1/rms, the
        down GEMM adding into the stream. Returns ``stream``."""
        from baton_kernels.triton.fused_ops import silu_and_mul

        mlp = self.dense_mlp
        gate_up = F.linear(stream, mlp.gate_up_proj.weight)
        act = silu_and_mul(gate_up, norm_of=stream, eps=self.post_attention_layernorm.eps)
        return stream.addmm_(act, mlp.down_proj.weight.t())


class CpuDecodeLayers:
    """The layer loop of a decode-only step on CPU as one C++ call
    (``csrc/decode_layers_cpu.cpp``): the same kernels as the Python layers, in the same order,
    so the hidden states are bit-identical; it saves the ~2 ms of Python between them in a
    decode step of 16 requests and releases the GIL once instead of ~300 times."""

    def __init__(self, ops: Any, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        self.ops = ops
        self.rotary = rotary
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size)
        self.eps = cfg.rms_norm_eps
        self.scale = 1.0  # the layers' attention scale (add_layer)
        self.windows: list[int] = []  # each layer's sliding window (0: none)
        # per layer: input norm, packed qkv, qkv bias (empty: none), packed o, post norm,
        # packed gate_up, packed down
        self.weights: list[torch.Tensor] = []

    def add_layer(self, layer: DecoderLayer) -> bool:
        """Append a layer's weights; False if one of its linear layers is not packed for the
        AVX512-BF16 GEMM with bf16 outputs."""
        attn, mlp = layer.self_attn, layer.dense_mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        packed = [m for m in linears if isinstance(m, PackedLinear) and m.kernel == "vnni"]
        if len(packed) != len(linears) or any(m.out_float32 for m in packed):
            return False
        qkv, o, gate_up, down = packed
        self.scale = attn.scale
        self.windows.append(attn.window)
        bias = qkv.bias
        no_bias = torch.empty(0, dtype=layer.input_layernorm.weight.dtype)
        self.weights += [
            layer.input_layernorm.weight.detach(),
            qkv.packed_weight,
            no_bias if bias is None else bias.detach(),
            o.packed_weight,
            layer.post_attention_layernorm.weight.detach(),
            gate_up.packed_weight,
            down.packed_weight,
        ]
        return True

    def __call__(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCacheView],
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` after the last layer, before the final norm."""
        # an 8-bit cache's K and V scales per layer (the kernels ignore them otherwise)
        kv_scales = [s for cache in kv_caches for s in (cache.k_scale, cache.v_scale)]
        hidden, residual = self.ops.decode_layers(
            hidden,
            positions,
            self.rotary.cos_sin,
            self.weights,
            [cache.kv for cache in kv_caches],
            md.slot_block,
            md.slot_offset,
            md.block_tables[: md.num_decodes],
            md.decode_seq_lens,
            *self.shape,
            self.eps,
            self.scale,
            self.windows if any(self.windows) else [],
            kv_scales if any(s != 1.0 for s in kv_scales) else [],
        )
        return hidden, residual


# Hugging Face name fragment -> (fused parameter fragment, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


# the projections whose outputs are added to the residual stream
_RESIDUAL_OUTPUTS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
_RESIDUAL_SCALES = ("o_proj.weight_scale", "down_proj.weight_scale")  # (an FP8 layer's)

# A vision-language checkpoint's language model (transformers < 5 and >= 5 name it so), and
# the rest of it
_LANGUAGE_MODEL = re.compile(r"^(?:language_model\.(?=model\.|lm_head\.)|model\.language_model\.)")
_VISION = re.compile(r"^(?:model\.)?(?:vision_tower|multi_modal_projector)\.")

# Gemma 2/3's norm names -> the layer's (its norm before the MLP is the Llama layers' second)
_SANDWICH_NORMS = {
    ".post_attention_layernorm.": ".attn_output_norm.",
    ".pre_feedforward_layernorm.": ".post_attention_layernorm.",
    ".post_feedforward_layernorm.": ".mlp_output_norm.",
}
_SANDWICH_RENAMES = re.compile("|".join(re.escape(k) for k in _SANDWICH_NORMS))

_STACKED_PARTS = {
    fused: tuple(part for part, (f, _) in _STACKED.items() if f == fused)
    for fused in ("qkv_proj", "gate_up_proj")
}

# One expert's weight (Mixtral's names, renamed to Qwen's by _EXPERT_RENAMES): layer, expert,
# part.
# the tensors whose rows are q or k heads' dimensions (reordered for a partial rotation)
_TURNED = re.compile(
    r"self_attn\.(q_proj|k_proj|q_norm|k_norm)\.(weight|bias|weight_scale|weight_packed|weight_zero)$"
)
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# an FP8 checkpoint's KV cache scales of a layer (model_loader.dequantized_fp8 names them so)
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.([kv])_scale$")
# The checkpoint's projections that are FP8 layers with W8A8 (``use_fp8_linears``): the
# attention's and the dense MLPs' (a mixture of experts' shared expert's too), not the
# experts', the router or the LM head.
FP8_LINEAR = re.compile(
    r"(?:^|\.)layers\.\d+\.(?:self_attn\.(?:q|k|v|o|qkv)_proj"
    r"|mlp\.(?:shared_expert\.)?(?:gate|up|down|gate_up)_proj)$"
)
_MIXTRAL_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# Granite-MoE's names: its experts stacked already, as transformers >= 5 stacks them
_GRANITE_MOE = {
    "router.layer.weight": "gate.weight",
    "input_linear.weight": "experts.gate_up_proj",
    "output_linear.weight": "experts.down_proj",
}
_EXPERT_RENAMES = re.compile(
    r"\.block_sparse_moe\.(?:(router\.layer\.weight|input_linear\.weight|output_linear\.weight)$)?"
    r"|(?<=\.experts\.)(\d+)\.(w[123])\."
)


def _expert_rename(m: re.Match[str]) -> str:
    if m.group(2) is None:
        return ".mlp." + _GRANITE_MOE.get(m.group(1) or "", "")
    return f"{m.group(2)}.{_MIXTRAL_PARTS[m.group(3)]}."


# Tensor parallelism (Megatron-style): these projections are split by output rows (column
# parallel: each rank computes its heads / its share of the MLP), those by input columns (row
# parallel: each rank's partial product, summed by ``DecoderLayer.reduce``). The rest (the
# embedding, the norms, the LM head) is replicated.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
# an integer layer's parts split by columns across ranks (IntLinear; a scale and zero point a
# row are every rank's)
_INT_PARTS = ("weight_packed", "weight_scale", "weight_zero")


def shard_config(cfg: ModelConfig, tp_size: int) -> ModelConfig:
    """The shape of one rank's shard of ``cfg`` split ``tp_size`` ways (its heads and its share
    of the MLP); raises ValueError if the model does not split evenly."""
    if tp_size == 1:
        return cfg
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("intermediate size", cfg.intermediate_size),
        ("experts' intermediate size", cfg.moe_intermediate_size),
        ("shared expert's intermediate size", cfg.shared_expert_intermediate_size),
    ):
        if n % tp_size:
            raise ValueError(
                f"tensor_parallel_size {tp_size} does not divide the model's {what} ({n})"
            )
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // tp_size,
        num_kv_heads=cfg.num_kv_heads // tp_size,
        intermediate_size=cfg.intermediate_size // tp_size,
        moe_intermediate_size=cfg.moe_intermediate_size // tp_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp_size,
    )


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        """``cfg`` is the whole model's shape; with ``tp_size`` > 1 this builds rank
        ``tp_rank``'s shard (``shard_config``), whose layers need ``set_reduce``."""
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        cfg = shard_config(cfg, tp_size)
        self.config = cfg
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )
        # Gemma 3's local layers: their own theta, unscaled (Attention.rope_index)
        self.rotary_local = (
            RotaryEmbedding(
                cfg.head_dim, max_positions, cfg.local_rope_theta, rotary_dim=cfg.rotary_dim
            )
            if cfg.local_rope_theta is not None
            else None
        )
        # a partial rotation's order of each q and k head's dimensions (rotary's docstring)
        self.rotation_order = (
            partial_rotation_order(cfg.head_dim, cfg.rotary_dim) if cfg.rotary_dim else None
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The LM head, or a classifier's head (one output per label: ``compute_logits`` then
        # gives the labels' logits).
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.num_outputs, bias=False)
        self.fused_rope = False
        self.cpu_decode_layers: CpuDecodeLayers | None = None
        self.gemv_rows = 0  # decode steps of at most this many rows run forward_gemv
        self.folded_norms = False  # decode steps run forward_folded (fold_norms)
        self.folded_prompts = False  # and the other steps' pieces are folded too (fold_norms)
        self.fp8_linears = False  # the projections are FP8 layers (use_fp8_linears)
        self.int_linears = False  # the projections are packed integer layers (use_int_linears)
        self.tie_weights()

    def reset_rotary(self, device: torch.device | str) -> None:
        """Recompute the rope tables in float32 on ``device`` (after building on "meta")."""
        for rotary in (self.rotary, self.rotary_local):
            if rotary is not None:
                rotary.reset(device)

    def set_reduce(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """The all-reduce that sums the row-parallel projections' partial outputs."""
        for layer in self.layers:
            cast(DecoderLayer, layer).reduce = reduce

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (again after moving the
        model off the "meta" device, which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCacheView],  # one per layer
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """``prompt_embeds``: the token rows whose inputs are given embeddings, and those
        embeddings (``embed``)."""
        ropes = self.rope_for(positions)
        decode_only = metadata.num_decodes == metadata.num_reqs
        if self.cpu_decode_layers and decode_only and metadata.decode_seq_lens is not None:
            hidden = self.embed(input_ids, prompt_embeds)
            last, stream = self.cpu_decode_layers(hidden, positions, kv_caches, metadata)
            return self.norm.add_forward(last, stream)[0]
        gemv = input_ids.shape[0] <= self.gemv_rows
        if decode_only and (gemv or self.folded_norms):
            # layers that update the residual stream in place (no norm kernel between them)
            layer_forward = DecoderLayer.forward_gemv if gemv else DecoderLayer.forward_folded
            stream = self.embed(input_ids, prompt_embeds)
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                layer = cast(DecoderLayer, layer)
                rope = ropes[layer.self_attn.rope_index]
                stream = layer_forward(layer, rope, stream, kv_cache, metadata, backend)
            return self.norm.add_forward(stream, None)[0]
        x, residual = self.piece(0, input_ids, None, prompt_embeds)
        for i, kv_cache in enumerate(kv_caches):
            out = self.attend(i, ropes, x, kv_cache, metadata, backend, residual)
            x, residual = self.piece(i + 1, out, residual)
        return x

    # The generic forward as alternating pieces, for prompt steps replayed piecewise from CUDA
    # graphs (``runner.cuda_graphs.PieceGraphs``): piece i is everything between attention i - 1
    # and attention i, with no host work and no dependence on the step's metadata; attention
    # runs eagerly between them.

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    def rope_for(self, positions: torch.Tensor) -> tuple[RopeTables | FusedRope, ...]:
        """The step's rotations: the model's rope, and Gemma 3's local one (each layer takes
        its ``Attention.rope_index``)."""
        ropes: list[RopeTables | FusedRope] = []
        for rotary in (self.rotary, self.rotary_local):
            if rotary is None:
                continue
            if self.fused_rope:
                ropes.append(FusedRope(positions, rotary.cos_sin))
            else:
                ropes.append(cast(RopeTables, rotary(positions, self.embed_tokens.weight.dtype)))
        return tuple(ropes)

    def piece(
        self,
        i: int,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Piece ``i`` of ``num_pieces``: from the token ids (``i = 0``) or attention
        ``i - 1``'s output to layer ``i``'s qkv, or (the last) to the final normed hidden
        states; returns it with the residual stream. With the norms folded into the prompts'
        layers too (``folded_prompts``) the stream is the whole residual stream, updated in
        place, and layer ``i``'s qkv is its projection without the norm and the bias, which
        the attention applies (``attend``)."""
        if self.folded_prompts:
            return self._folded_piece(i, x, residual, prompt_embeds)
        if i == 0:
            hidden, residual = self.embed(x, prompt_embeds), None
        else:
            assert residual is not None
            hidden, residual = cast(DecoderLayer, self.layers[i - 1]).post_attention(x, residual)
        if i == len(self.layers):
            return self.norm.add_forward(hidden, residual)
        return cast(DecoderLayer, self.layers[i]).pre_attention(hidden, residual)

    def _folded_piece(
        self,
        i: int,
        x: torch.Tensor,
        stream: torch.Tensor | None,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``piece`` as ``DecoderLayer.forward_folded`` runs a layer: o_proj and down_proj
        add into the stream in their GEMMs, SiLU-and-multiply applies the second norm, and no
        norm kernel runs but the final one."""
        if i == 0:
            stream = self.embed(x, prompt_embeds)
        else:
            assert stream is not None
            layer = cast(DecoderLayer, self.layers[i - 1])
            stream.addmm_(x, layer.self_attn.o_proj.weight.t())
            layer.folded_mlp(stream)
        assert stream is not None
        if i == len(self.layers):
            return self.norm.add_forward(stream, None)
        qkv_proj = cast(DecoderLayer, self.layers[i]).self_attn.qkv_proj
        return F.linear(stream, qkv_proj.weight), stream

    def attend(
        self,
        i: int,
        ropes: tuple[RopeTables | FusedRope, ...],
        qkv: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``i``'s attention of its projected ``qkv``: ``[T, q]``. ``stream``: the
        residual stream of the step's tokens, whose norm the attention applies to a folded
        layer's ``qkv`` (``folded_prompts``)."""
        layer = cast(DecoderLayer, self.layers[i])
        norm = None
        if self.folded_prompts:
            assert stream is not None, "a folded layer's attention needs the residual stream"
            norm = layer.folded_norm(stream)
        attn = layer.self_attn
        return attn.attend(ropes[attn.rope_index], qkv, kv_cache, metadata, backend, norm)

    def use_cpu_decode_layers(self, ops: Any) -> bool:
        """Run the layers of decode-only steps as one C++ call (``CpuDecodeLayers``) if the
        model qualifies: fused kernels on, every linear layer packed for the AVX512-BF16 GEMM
        with bf16 outputs, Llama's layers (``ModelConfig.plain_layers``; sliding windows
        included), no softcap. The caller vouches for the attention
        backend (its decode must be the C++ kernel). Call after the weights are loaded and
        packed; returns whether the path is on."""
        self.cpu_decode_layers = None
        cfg = self.config
        if (
            ops is None
            or not self.fused_rope
            or not cfg.plain_layers
            or cfg.attn_logit_softcapping
            or self.tp_size > 1
            or self.quantized_linears
        ):
            return False  # (the C++ loop has no all-reduce, experts, softcap or FP8 layers)
        layers = CpuDecodeLayers(ops, self.config, self.rotary)
        if not all(layers.add_layer(cast(DecoderLayer, layer)) for layer in self.layers):
            return False
        self.cpu_decode_layers = layers
        return True

    def use_gemv_decode(self, rows: int = 1, mlp: bool = True, down: bool = False) -> bool:
        """Run decode steps of at most ``rows`` rows through ``DecoderLayer.forward_gemv``
        (Triton GEMV kernels with the norms, SiLU and residual adds inside: 5 launches a layer
        instead of 8; with ``mlp`` off, the attention's projections only, and with ``down``
        the down projection too once the norms are folded, ``fold_norms``). Needs the fused
        kernels on (``use_fused_kernels``) and Llama's two norms and SiLU
        (``ModelConfig.gemv_layers``: q/k norms and experts too); returns whether the path is
        on."""
        from baton_kernels.triton.gemv import MAX_ROWS

        ok = (
            self.fused_rope
            and self.config.gemv_layers
            and self.tp_size == 1  # (the residual adds inside the GEMVs precede no all-reduce)
            and not self.quantized_linears
            and 0 < rows <= MAX_ROWS
        )
        self.gemv_rows = rows if ok else 0
        for layer in self.layers:
            cast(DecoderLayer, layer).gemv_mlp = mlp
            cast(DecoderLayer, layer).gemv_down = down
        return ok

    def fold_norms(self, prompts: bool = False) -> bool:
        """Fold each layer's two RMSNorm weights into the projection after each (qkv and
        gate/up: ``W[:, j] *= w[j]``, rounded to the weights' dtype once; the norms' weights
        become ones, so every other path computes the same model), and run decode-only steps
        of more than ``gemv_rows`` rows through ``DecoderLayer.forward_folded``, without the
        norms' kernels; with ``prompts`` every other step's layers too (``piece``). Needs the
        fused kernels on (``use_fused_kernels``), an attention backend whose ``forward_rope``
        takes a ``DecodeNorm`` (on decode-only steps, and on all with ``prompts``: the caller
        vouches), Llama's layers (``ModelConfig.plain_layers``), one rank (o_proj and
        down_proj add into the residual stream before any all-reduce), and GPU-side Triton (or
        its interpreter).
        Call after the weights are loaded; a second call folds what the norms hold then (ones,
        unless they were changed). Returns whether the path is on."""
        if (
            not self.fused_rope
            or not self.config.plain_layers
            or self.tp_size > 1
            or self.quantized_linears
        ):
            return False
        with torch.no_grad():
            for layer in self.layers:
                layer = cast(DecoderLayer, layer)
                for norm, proj in (
                    (layer.input_layernorm, layer.self_attn.qkv_proj),
                    (layer.post_attention_layernorm, layer.dense_mlp.gate_up_proj),
                ):
                    w = proj.weight
                    w.copy_(w.float().mul_(norm.weight.float()).to(w.dtype))
                    norm.weight.fill_(1.0)
                layer.folded_norms = True
        self.folded_norms = True
        self.folded_prompts = prompts
        return True

    def use_fp8_linears(self) -> int:
        """Make the layers' projections FP8 layers (``Fp8Linear``, W8A8; ``FP8_LINEAR`` names
        them in a checkpoint): the attention's qkv and o, the dense MLPs' gate/up and down.
        Call before the weights are loaded (the new layers are empty, on the old ones'
        device). The decode paths that read the weights themselves (GEMV layers, folded
        norms, one-call CPU decode) are then off. Returns how many layers were replaced."""
        replaced = 0
        for module in list(self.modules()):
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(module, name, None)
                if isinstance(module, Attention | MLP) and isinstance(linear, nn.Linear):
                    setattr(module, name, Fp8Linear.like(linear))
                    replaced += 1
        self.fp8_linears = replaced > 0
        return replaced

    def use_int_linears(self, bits: int, group_size: int | None) -> int:
        """Make the layers' projections (those of ``use_fp8_linears``) packed integer layers
        (``IntLinear``: ``bits``-bit values, a scale and zero point a row and group of
        ``group_size`` columns, else a row), if every one of this rank's can hold that layout;
        else none. Call before the weights are loaded; the decode paths that read the weights
        themselves are then off. Returns how many layers were replaced."""
        places = [
            (module, name, linear)
            for module in self.modules()
            if isinstance(module, Attention | MLP)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            if isinstance(linear := getattr(module, name, None), nn.Linear)
        ]
        span = span_cols(bits)
        split = [  # (a rank's words must be whole spans of the whole row's)
            linear.in_features % span for _, name, linear in places if name in ROW_PARALLEL
        ]
        if self.tp_size > 1 and any(split):
            return 0
        try:
            layers = [IntLinear.like(linear, bits, group_size) for _, _, linear in places]
        except ValueError:  # (a rank's columns that a group does not divide)
            return 0
        for (module, name, _), layer in zip(places, layers, strict=True):
            setattr(module, name, layer)
        self.int_linears = bool(layers)
        return len(layers)

    @property
    def quantized_linears(self) -> bool:
        """Whether the projections are FP8 or integer layers (no ``weight`` to read)."""
        return self.fp8_linears or self.int_linears

    def kv_scales(self) -> list[tuple[float, float]]:
        """Each layer's KV cache scales (K, V): an FP8 checkpoint's calibrated ones (or those
        ``set_kv_scales`` gave), else 1."""
        attentions = [cast(DecoderLayer, layer).self_attn for layer in self.layers]
        return [(attn.k_scale, attn.v_scale) for attn in attentions]

    def set_kv_scales(self, scales: list[tuple[float, float]]) -> None:
        """Each layer's KV cache scales (K, V), in place of the checkpoint's."""
        for layer, (k, v) in zip(self.layers, scales, strict=True):
            attn = cast(DecoderLayer, layer).self_attn
            attn.k_scale, attn.v_scale = k, v

    def attention_options(self) -> list[tuple[int, float]]:
        """The layers' distinct ``(window, softcap)`` (kernel variants to compile ahead)."""
        attentions = [cast(DecoderLayer, layer).self_attn for layer in self.layers]
        return sorted({(attn.window, attn.softcap) for attn in attentions})

    def use_fused_kernels(self) -> None:
        """Run the residual add + RMSNorm, the rotary embedding and SiLU-and-multiply as fused
        kernels (``baton_kernels.fused``; the results equal the torch ops' within a rounding)."""
        self.fused_rope = True
        for module in self.modules():
            if isinstance(module, RMSNorm | MLP | SparseMoE):
                module.fused = True

    def use_triton_experts(self) -> bool:
        """Run a mixture of experts' experts as Triton's grouped GEMMs at every step
        (``baton_kernels.triton.moe``: static shapes, so CUDA graphs hold them). Returns
        whether the model has experts."""
        layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        for layer in layers:
            layer.triton_experts = True
        return bool(layers)

    def embed(
        self,
        input_ids: torch.Tensor,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The token embeddings (times Granite's ``embedding_multiplier``, or Gemma's
        sqrt(hidden) rounded to the model's dtype). ``prompt_embeds`` (rows, values): those
        rows' inputs are the values instead, as Hugging Face's ``inputs_embeds``: Granite's
        multiplier scales them, Gemma's scale not (its table's lookup has it, as there)."""
        hidden: torch.Tensor = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        if self.config.embedding_multiplier_in_dtype:
            multiplier = _rounded(multiplier, hidden.dtype)
        scaled_in_table = self.config.embedding_multiplier_in_dtype  # (Gemma's)
        if prompt_embeds is not None and not scaled_in_table:
            hidden.index_copy_(0, *prompt_embeds)
        if multiplier != 1.0:
            hidden = hidden * multiplier
        if prompt_embeds is not None and scaled_in_table:
            hidden.index_copy_(0, *prompt_embeds)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(hidden)
        scaling = self.config.logits_scaling
        if scaling != 1.0:
            logits = logits / scaling
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy Hugging Face-named tensors in, splitting into fused projections. Returns the
        names of parameters that were loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        expert_parts: dict[str, set[tuple[int, str]]] = {}  # stacked parameter -> pieces in
        for hf_name, tensor in self._split_fused(weights):
            name = hf_name
            if self.config.text_of_multimodal:
                if _VISION.match(name):
                    continue  # (prompts are text: the vision tower is not built)
                name = _LANGUAGE_MODEL.sub("", name)
            name = _EXPERT_RENAMES.sub(_expert_rename, name.removeprefix("model."))
            if self.config.sandwich_norms:
                name = _SANDWICH_RENAMES.sub(lambda m: _SANDWICH_NORMS[m.group(0)], name)
            if name.endswith("norm.weight") and self.config.norm_weight_offset:
                # Gemma's norms scale by (1 + weight): the sum, once, in float32
                tensor = tensor.float() + self.config.norm_weight_offset
            kv_scale = _KV_SCALE.match(name)
            if kv_scale is not None:  # (FP8 checkpoints: model_loader.dequantized_fp8)
                layer, part = kv_scale.groups()
                if tensor.numel() != 1:
                    raise ValueError(f"{hf_name!r}: one KV cache scale a layer is read, not "
                                     f"{tuple(tensor.shape)}")  # fmt: skip
                attn = cast(DecoderLayer, self.layers[int(layer)]).self_attn
                setattr(attn, f"{part}_scale", float(tensor.float().item()))
                continue
            if name == "score.weight" and self.config.is_classifier:
                name = "lm_head.weight"  # (transformers' name for a classifier's head)
            if "rotary_emb" in name or (
                name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensor = self._tp_slice_stacked(name, tensor)
            else:
                tensor = self._tp_slice(name, tensor)
            if self.rotation_order is not None and _TURNED.search(name):
                tensor = reorder_heads(tensor, self.rotation_order)
            if self.config.residual_multiplier != 1.0 and (
                (name.endswith(_RESIDUAL_OUTPUTS) and tensor.dtype != FP8_DTYPE)
                or name.endswith(_RESIDUAL_SCALES)
            ):
                # Granite scales what these add to the residual stream: in the weights (an
                # FP8 weight's scales), once
                tensor = tensor * self.config.residual_multiplier
            expert = _EXPERT.match(name)
            if expert is not None:
                layer, index, part = expert.groups()
                mlp = cast(DecoderLayer, self.layers[int(layer)]).mlp
                if not isinstance(mlp, SparseMoE) or int(index) >= len(mlp.experts.down_proj):
                    raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
                stacked = f"layers.{layer}.mlp.experts.{mlp.experts.load(int(index), part, tensor)}"
                expert_parts.setdefault(stacked, set()).add((int(index), part))
                continue
            shard = None
            for frag, (fused_name, idx) in _STACKED.items():
                if f".{frag}." in name:
                    name, shard = name.replace(frag, fused_name), idx
                    break
            param = params.get(name)
            if param is None and self.int_linears and name.endswith(".weight"):
                module = self.get_submodule(name.removesuffix(".weight"))
                if isinstance(module, IntLinear):
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} is not quantized in the layout of the "
                        "model's other projections, which stay packed "
                        "(BATON_PACKED_INT_WEIGHTS=0 dequantizes them all on load)"
                    )
            if param is None:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
                raise ValueError(f"checkpoint tensor {hf_name!r} is FP8, its parameter "
                                 f"{param.dtype}")  # fmt: skip
            rows = _shard_range(self.config, param, name, shard) if shard is not None else None
            if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                # a higher-precision weight into an FP8 layer: quantized, a scale a row
                fp8 = cast(Fp8Linear, self.get_submodule(name.removesuffix(".weight")))
                fp8.load_rows_(tensor, rows[0] if rows is not None else 0)
                loaded.add(f"{name}_scale")
            else:
                target = param if rows is None else param.narrow(0, *rows)
                if target.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {hf_name!r} has shape "
                                     f"{tuple(tensor.shape)}, its place "
                                     f"{tuple(target.shape)}")  # fmt: skip
                with torch.no_grad():
                    target.copy_(tensor)
            loaded.add(name)
        # a stacked parameter is loaded once every expert's pieces are
        loaded.update(
            name
            for name, pieces in expert_parts.items()
            if len(pieces) == params[name].shape[0] * (2 if name.endswith("gate_up_proj") else 1)
        )
        return loaded

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``weights`` with a checkpoint's fused projections (Phi-3's ``qkv_proj`` and
        ``gate_up_proj``) as their parts, named as the other checkpoints name them (so that
        they are split across ranks as those are)."""
        cfg, tp = self.config, self.tp_size
        q, kv = cfg.num_heads * tp * cfg.head_dim, cfg.num_kv_heads * tp * cfg.head_dim
        for name, tensor in weights:
            fused = name.rsplit(".", 2)
            if len(fused) == 3 and fused[1] in ("qkv_proj", "gate_up_proj"):
                sizes = [q, kv, kv] if fused[1] == "qkv_proj" else [tensor.shape[0] // 2] * 2
                parts = _STACKED_PARTS[fused[1]]
                for part, piece in zip(parts, torch.split(tensor, sizes), strict=True):
                    yield f"{fused[0]}.{part}.{fused[2]}", piece
            else:
                yield name, tensor

    def _tp_slice_stacked(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a layer's stacked experts (``[E, 2I, H]`` gate and up, or
        ``[E, H, I]`` down): its share of each expert's ``I``."""
        if self.tp_size == 1:
            return tensor
        if name.endswith("down_proj"):
            size = tensor.shape[2] // self.tp_size
            return tensor.narrow(2, self.tp_rank * size, size)
        size = tensor.shape[1] // 2 // self.tp_size
        e, _, h = tensor.shape
        halves = tensor.view(e, 2, -1, h)  # [E, 2, I, H]
        return halves.narrow(2, self.tp_rank * size, size).reshape(e, -1, h)

    def _tp_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole checkpoint tensor (all of it when replicated)."""
        if self.tp_size == 1:
            return tensor
        parts = name.split(".")
        if any(p in parts for p in COLUMN_PARALLEL):
            dim = 0  # weight rows and bias
        elif any(p in parts for p in ROW_PARALLEL) and (
            parts[-1] == "weight"
            or (parts[-1] in _INT_PARTS and tensor.dim() == 2 and tensor.shape[1] > 1)
        ):
            dim = 1  # (an integer layer's words, scales and zero points by groups of columns)
        else:
            return tensor
        if tensor.shape[dim] % self.tp_size:
            raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)} does "
                             f"not split {self.tp_size} ways")  # fmt: skip
        size = tensor.shape[dim] // self.tp_size
        return tensor.narrow(dim, self.tp_rank * size, size)


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (once per pair, not in every forward pass)."""
    return float(torch.tensor(value, dtype=dtype).item())


def _shard_range(cfg: ModelConfig, param: torch.Tensor, name: str, shard: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``shard`` of a fused projection's rows (q, k, v or gate,
    up: a shared expert's MLP has its own size)."""
    if "qkv_proj" in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return ((0, q), (q, kv), (q + kv, kv))[shard]
    size = param.shape[0] // 2
    return (shard * size, size)

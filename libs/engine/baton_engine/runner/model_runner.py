"""ModelRunner: owns the model, the KV pool and the sampler; runs one step per SchedulerOutput."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import accumulate
from typing import NamedTuple

import numpy as np
import torch

from baton_engine import distributed
from baton_engine.config import ModelConfig
from baton_engine.core.outputs import (
    GrammarBitmask,
    ModelRunnerOutput,
    SchedulerOutput,
    TokenLogprobs,
)
from baton_engine.errors import InvalidRequestError
from baton_engine.kv_cache.host_cache import KVCopy
from baton_engine.logits_processor import LogitsProcessors
from baton_engine.lora import LoRALimits, LoRAManager
from baton_engine.models import LlamaForCausalLM, moe
from baton_engine.models.llama import shard_config
from baton_engine.models.moe import Experts
from baton_engine.pooling_params import PoolerConfig
from baton_engine.runner.cuda_graphs import DEFAULT_CAPTURE_SIZES, DecodeGraphs, PieceGraphs
from baton_engine.runner.draft import DraftProposer
from baton_engine.runner.input_batch import CachedRequestState, InputBatch
from baton_engine.runner.staging import InputStaging
from baton_engine.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    compute_logprobs,
    draw_seed,
)
from baton_engine.sampling_params import SamplingParams
from baton_engine.spec_decode import draft_rows, kept_tokens, verify
from baton_kernels import fused
from baton_kernels.attention import AttentionMetadata, KVCacheView, create_attention_backend
from baton_kernels.attention.base import FP8_KV_DTYPES, copy_blocks_, to_cache_dtype
from baton_kernels.cpu_linear import pack_linears
from baton_kernels.cpu_ops import load_cpu_ops
from baton_kernels.fp8_linear import FP8_DTYPE, Fp8Linear
from baton_kernels.int_linear import IntLinear

logger = logging.getLogger(__name__)
# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a calculated KV cache scale is max|K| / 200
# (max|V| / 100), so that e4m3's 448 leaves room for values beyond the calibration pass's
KV_SCALE_RANGES = (200.0, 100.0)
# A step's grammar bitmask, made when asked for (EngineCore fills it on the host).
GrammarSource = Callable[[], GrammarBitmask | None]

# One-request decode steps on a GPU run the layers as fused Triton GEMVs (the norms, SiLU and the
# residual adds inside the projections) for models up to this hidden size. On an H200 the
# 24-layer Qwen2.5-0.5B stack (hidden 896) took 26% less time that way; Llama-3.1-8B's (4096),
# whose projections are long bandwidth-bound reads that cuBLAS does as well, took 1% more
# (benchmarks/bench_gemv_gpu.py). With programmatic dependent launch the Llama engine's batch-1
# graph still took 4.64 ms this way against 4.48 with cuBLAS (benchmarks/device/ab_pdl.sh).
GEMV_MAX_HIDDEN = 2048
# Above that, up to this hidden size, only the attention's projections run as GEMVs (qkv with the
# norm before it, o_proj with the residual add after it), where cuBLAS read Llama-3.1-8B's
# shorter weights at 2.4-2.9 TB/s against the GEMV's 2.6-3.1 (bench_gemv_gpu.py); the MLP stays
# with cuBLAS. Llama's batch-1 graph: 4.351 / 4.398 ms against 4.389 / 4.414 with cuBLAS
# layers (benchmarks/device/ab_b1.sh, two machines).
GEMV_ATTN_MAX_HIDDEN = 8192
# With only the attention's projections as GEMVs and the norms folded, the down projection too,
# SiLU-and-multiply and the folded norm inside it (on the fixed-grid kernel, gemv.choose_launch):
# one launch fewer a layer and no split-K reduce. Llama-3.1-8B's batch-1 graph on an H200: 4.276 /
# 4.279 ms against 4.287 / 4.293 with cuBLAS's GEMM after the SiLU kernel (219.8 / 220.9 tok/s
# against 218.6 / 219.4; benchmarks/device/ab_gemv_down.sh). BATON_GEMV_DOWN=0 turns it off.
GEMV_DOWN = os.environ.get("BATON_GEMV_DOWN", "1") != "0"
# Decode steps of at most this many requests take that path. With 2 and 4 rows the kernel (its
# launch fitted to one row) was slower than cuBLAS: Qwen batch 4 2,609 against 3,758 tok/s
# (benchmarks/device/ab_gemv_rows.sh).
GEMV_ROWS = 1
# A decode-graph step of the same requests in the same order as the step launched just before
# reuses that step's rows and positions (one further) instead of reading every request's state
# again (_DecodeGather): ~30 of the ~355 Python bytecodes a request costs the host per decode
# step (benchmarks/bench_host_step.py --bytecodes). False: every step reads them.
REUSE_GATHER = True
# Steps of decodes and drafts replay the decode graphs, a row a token (False: they run eagerly,
# or as prompt-step pieces; an A/B switch for benchmarks/device/spec_probe.py).
SPLIT_GRAPHS = True
# Decode steps on a GPU run with each layer's RMSNorms folded into the projections after them
# (LlamaForCausalLM.fold_norms): 2 launches fewer a layer. On an H200 the decode graph took
# 1.69-1.70 ms against 1.79 for Qwen2.5-0.5B at 256 rows, 1.04 against 1.12 at 64, and
# Llama-3.1-8B's batch-1 graph 4.31 against 4.37 (benchmarks/device/ab_fold.sh).
FOLD_NORMS = True
# ... and in every other step's layers (prompt chunks, mixed steps): the rotary kernel applies
# the input norm, SiLU-and-multiply the second, o_proj and down_proj add into the residual
# stream; no norm kernel a layer (49 a step for Qwen2.5-0.5B, 1.39 ms of a 23.1 ms prompt step
# of 16,384 tokens on an H200, benchmarks/profile_gpu_steps.py). BATON_FOLD_PROMPTS=0: not.
FOLD_PROMPTS = os.environ.get("BATON_FOLD_PROMPTS", "1") != "0"
# LoRA adapters on a GPU: each projection's deltas from one GEMM with the slots' A below the base
# weight and the Triton expand kernel (baton_kernels.triton.lora) instead of a shrink GEMM, a
# mask multiply and an expand GEMM. On an H200, with 4 rank-16 adapters mixed: Qwen2.5-0.5B
# 32,284 against 23,037 tok/s (64 x 512 in / 128 out), Llama-3.1-8B 2,935 against 2,678 (32 x
# 512 / 64; benchmarks/bench_lora.py --compare-gemms). BATON_LORA_EXPAND_KERNEL=0: the GEMMs.
LORA_EXPAND_KERNEL = os.environ.get("BATON_LORA_EXPAND_KERNEL", "1") != "0"
# How often a wait for the device checks that the tensor-parallel ranks are alive.
_POLL_S = 50e-6


def _host_free(state: CachedRequestState) -> bool:
    """Sampling needs none of the request's own tokens on the host: no penalties, no logprobs,
    no bad words, past ``min_tokens`` (counting only tokens already reported)."""
    return state.host_free and state.num_output_tokens >= state.sampling_params.min_tokens


# torch.nn.init's functions that modules' reset_parameters call (nn.Linear, nn.Embedding)
_INIT_FUNCTIONS = ("uniform_", "normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
                   "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_")  # fmt: skip


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """Modules built inside on "meta" skip their parameters' random initialization (as
    transformers' ``no_init_weights``): it draws nothing there, but runs torch's Python
    references, whose first use imported torch._dynamo (1.1 s of an engine's start on a 2-core
    CPU). Other tensors (another thread's) are initialized as usual."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}

    def skipping(name: str) -> Callable[..., torch.Tensor]:
        def init(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            return tensor if tensor.is_meta else saved[name](tensor, *args, **kwargs)

        return init

    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, skipping(name))
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _next_index(state: CachedRequestState) -> int:
    """The index of the output token ``state`` samples next (its pending ones counted): a
    seeded request's draw for it uses ``draw_seed(seed, index)``."""
    return state.num_output_tokens + state.num_pending


def _seeded(reqs: Sequence[CachedRequestState]) -> list[tuple[int, int, int]]:
    """The seeded requests among ``reqs`` (sampling at random): each one's index in ``reqs``,
    its seed and the index of the output token it samples next."""
    return [(i, s.seed, _next_index(s)) for i, s in enumerate(reqs) if s.seed is not None]


def _plain_greedy(state: CachedRequestState) -> bool:
    """Greedy with nothing that changes or reports the logits: no penalties, no logprobs, no
    tokens suppressed below ``min_tokens``."""
    return state.plain_greedy and state.num_output_tokens >= state.sampling_params.min_tokens


class _DecodeGather(NamedTuple):
    """What a decode-graph launch gathered from its requests' states, for the next launch to
    reuse when it runs the same requests in the same order right after (a steady decode
    batch): then every request is one token further (each was scheduled one token, and none
    was dropped and resumed, which would have changed ``InputBatch.num_removed``), and if
    every row sampled, every row samples again (each has one more known token, pending)."""

    launch: int  # ModelRunner._num_launches at that launch
    order: list[str]  # its requests' ids in order
    num_removed: int  # InputBatch.num_removed then
    reqs: list[CachedRequestState]
    rows: np.ndarray  # their rows of the tables
    pos: np.ndarray  # their input tokens' positions
    all_sampled: bool

    def fewer(self, order: list[str]) -> _DecodeGather | None:
        """This gathering for ``order`` when it is this launch's requests in the same order
        less some (finished or preempted since, while none joined or resumed: the caller
        checks that), else None: the last steps of a batch whose requests end at different
        steps keep the steady batch's saving."""
        keep: list[int] = []
        j, n = 0, len(order)
        for i, req_id in enumerate(self.order):
            if j < n and order[j] == req_id:
                keep.append(i)
                j += 1
        if j < n:
            return None
        idx = np.asarray(keep, dtype=np.intp)
        reqs = self.reqs
        return self._replace(
            order=order, reqs=[reqs[i] for i in keep], rows=self.rows[idx], pos=self.pos[idx]
        )


class _SpecCheck(NamedTuple):
    """A step's drafts being checked: the requests that had some, their drafts, and on the
    device whether each draft holds then the token each position gives (``spec_decode.verify``,
    one tensor); with logprobs asked for, those of the token each position keeps if kept."""

    states: list[CachedRequestState]
    drafts: list[list[int]]
    outcome: torch.Tensor
    logprobs: LogprobsTensors | None = None

    def tokens(self) -> tuple[list[list[int]], dict[str, list[TokenLogprobs]]]:
        """Each request's kept drafts and the token after them, and the logprobs of those
        that asked (reads the outcome)."""
        outcome = self.outcome.tolist()
        num_drafts = sum(len(d) for d in self.drafts)
        tokens = kept_tokens(self.drafts, outcome[:num_drafts], outcome[num_drafts:])
        logprobs: dict[str, list[TokenLogprobs]] = {}
        if self.logprobs is not None:
            ids, values = self.logprobs.token_ids.tolist(), self.logprobs.logprobs.tolist()
            ranks = self.logprobs.ranks.tolist()
            row = 0  # the request's first row
            for state, drafts, kept in zip(self.states, self.drafts, tokens, strict=True):
                n = state.sampling_params.logprobs
                if n is not None:
                    logprobs[state.req_id] = [
                        TokenLogprobs(ids[r][: 1 + n], values[r][: 1 + n], int(ranks[r]))
                        for r in range(row, row + len(kept))
                    ]
                row += len(drafts) + 1
        return tokens, logprobs


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        attention_backend: str = "auto",
        tp_rank: int = 0,
        tp_size: int = 1,
        num_scheduler_steps: int = 1,
        lora: LoRALimits | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        fp8_linears: bool = False,
        int_linears: tuple[int, int | None] | None = None,
        logprobs_mode: str = "raw_logprobs",
    ) -> None:
        """``model_config`` is the whole model's; with ``tp_size`` > 1 the runner holds rank
        ``tp_rank``'s shard (``model_config`` then becomes the shard's shape: its heads, its
        share of the MLP) and must run in that rank's process of the group
        (``baton_engine.distributed``). ``lora``: serve LoRA adapters within those limits
        (``self.lora``, once the weights are final); the fused decode paths are then off.
        ``kv_cache_dtype``: the KV cache's (None: ``dtype``; an 8-bit float stores K and V
        rounded to it, ``attention.base.FP8_KV_DTYPES``). ``fp8_linears``: the projections
        are FP8 layers (W8A8, ``LlamaForCausalLM.use_fp8_linears``); ``int_linears``: (bits,
        group size) of packed integer layers the projections are where they can hold them
        (``LlamaForCausalLM.use_int_linears``; ``self.model.int_linears`` says whether).
        ``logprobs_mode``: what sampled tokens' logprobs report (``sampler.LOGPROBS_MODES``)."""
        self.lora_limits = lora
        self.lora: LoRAManager | None = None
        self.pooler = PoolerConfig()  # how embeddings pool (EngineCore sets it)
        self.whole_config = whole_config = model_config
        model_config = shard_config(model_config, tp_size)
        self.model_config = model_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Tensor parallelism, rank 0: raises once a helper rank is gone. Waits for the device
        # then poll and call it, since a collective waiting for a dead rank never completes.
        self.check_ranks: Callable[[], None] | None = None
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype or dtype
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend = create_attention_backend(
            attention_backend,
            self.device.type,
            dtype=dtype,
            head_dim=model_config.head_dim,
            kv_dtype=self.kv_dtype,
        )
        if self.device.type == "cuda":
            # cuDNN's SDPA recompiles for every new KV length (the torch backend's varlen case).
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs
        self.pieces: PieceGraphs | None = None  # other steps, piecewise from CUDA graphs
        logger.info("attention backend: %s", self.backend.name)
        self.sampler = Sampler(logprobs_mode)
        self.batch = InputBatch(max_num_seqs, max_model_len, block_size, self.device)
        # Custom logits processors (set_logits_processors); None: none
        self.logits_processors: LogitsProcessors | None = None
        # Step inputs, reused every step (CPU; copied to the device when there is one).
        self._input_ids = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._positions = np.zeros(max_num_batched_tokens, dtype=np.int64)
        self._arange = np.arange(max_num_batched_tokens, dtype=np.int64)
        # The last launched step's sampled ids (on the device) and the requests that sampled
        # them, in order: the inputs of the next step's decodes while still pending.
        self._last_sampled: torch.Tensor | None = None
        self._last_sampled_reqs: list[CachedRequestState] = []
        self._num_launches = 0
        self._gathered: _DecodeGather | None = None  # the last launch's, if a decode graph's
        self.num_steady_launches = 0  # launches that reused the previous one's (REUSE_GATHER)
        self._host_flip = 0
        # room for one step's inputs: the block table, and a few int64 arrays per token
        max_blocks = -(max_model_len // -block_size)
        self.staging = InputStaging(
            self.device, 8 * (max_num_seqs * max_blocks + 8 * max_num_batched_tokens) + (1 << 16)
        )
        self._host_ids = [  # a step's sampled ids: one a request, a pass (num_scheduler_steps)
            torch.empty(
                max_num_seqs * num_scheduler_steps,
                dtype=torch.int64,
                pin_memory=self.device.type == "cuda",
            )
            for _ in range(2)
        ]
        with torch.device("meta"), _no_init():
            self.model = LlamaForCausalLM(whole_config, max_model_len, tp_rank, tp_size)
        if tp_size > 1:
            self.model.set_reduce(distributed.all_reduce)
        # in the model's dtype before any memory is taken (float32 first would need twice the
        # bytes: more than an H200 holds for a rank of Llama-3.1-70B at TP 2)
        self.model.to(dtype)
        if fp8_linears:  # (after the cast to dtype, which would make them 16-bit again)
            self.model.use_fp8_linears()
        if int_linears is not None:
            self.model.use_int_linears(*int_linears)
        self.model.to_empty(device=self.device)
        self.model.tie_weights()
        self.model.reset_rotary(self.device)
        self.model.eval()
        if self.backend.name != "torch" and fused.available(self.device):
            self.model.use_fused_kernels()  # (the torch backend is the reference: torch ops)
            if self.device.type == "cuda" and moe.TRITON_EXPERTS:
                self.model.use_triton_experts()
            hidden = model_config.hidden_size
            if (
                lora is None
                and self.device.type == "cuda"
                and hidden <= max(GEMV_MAX_HIDDEN, GEMV_ATTN_MAX_HIDDEN)
                and self.model.use_gemv_decode(
                    rows=GEMV_ROWS, mlp=hidden <= GEMV_MAX_HIDDEN, down=GEMV_DOWN
                )
            ):
                logger.info(
                    "decode steps of up to %d requests run %s as fused GEMV kernels",
                    GEMV_ROWS,
                    "the layers"
                    if hidden <= GEMV_MAX_HIDDEN and not model_config.is_moe
                    else "the attention projections",
                )
        self.kv_pool: torch.Tensor | None = None
        self.host_kv: torch.Tensor | None = None  # the host tier (initialize_host_kv_cache)
        self.kv_caches: list[KVCacheView] = []
        self.draft: DraftProposer | None = None  # a draft model's (attach_draft)
        # Sleep mode (``sleep``): the parts asleep ("weights", "kv_cache"), the weights' host
        # copies (level 1), how to read them again (level 2: set by whoever loaded them), and
        # the graphs to capture again on waking (``enable_decode_graphs``' and
        # ``enable_piece_graphs``' arguments).
        self.asleep: set[str] = set()
        self._weights_backup: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []
        # level 1's host copy of the weights, page-locked; kept after waking for the next sleep
        # (as torch's pinned-memory cache keeps vLLM's), given back at level 2
        self._host_copy: _PageLocked | None = None
        self.reload_weights: Callable[[], None] | None = None
        self.packed_weights = False  # packed for the CPU's kernels (finalize_weights)
        self._graph_args: dict[str, tuple[bool, int]] = {}

    # --- setup ---------------------------------------------------------------------------------

    def set_logits_processors(self, processors: LogitsProcessors) -> None:
        """Run ``processors`` on every step's logits (before any request is added): each
        request's sampling then reads its tokens on the host."""
        assert not self.batch.requests, "processors are set before any request comes"
        self.logits_processors = processors
        self.batch.host_bound = True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loaded = self.model.load_weights(weights)
        missing = {n for n, _ in self.model.named_parameters()} - loaded
        if self.model_config.tie_word_embeddings:
            missing.discard("lm_head.weight")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def load_dummy_weights(self, seed: int = 0) -> None:
        """Random weights of the right shapes (for benchmarks): small normal values, unit norms.
        Drawn on the model's device, so an 8B model needs no host memory or copy."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if "norm" in name:
                    param.fill_(1.0)
                elif (
                    param.is_floating_point()
                    and param.dtype != FP8_DTYPE
                    and not (name.endswith(".weight_scale"))
                ):
                    noise = torch.randn(param.shape, generator=gen, device=self.device)
                    param.copy_(noise.mul_(0.02))
            for module in self.model.modules():
                if isinstance(module, Fp8Linear):  # (drawn as the others, then quantized)
                    noise = torch.randn(module.weight.shape, generator=gen, device=self.device)
                    module.load_rows_(noise.mul_(0.02))
                elif isinstance(module, IntLinear):  # (quantized by groups)
                    noise = torch.randn(module.out_features, module.in_features, generator=gen,
                                        device=self.device)  # fmt: skip
                    module.quantize_(noise.mul_(0.02))

    def finalize_weights(self) -> None:
        """After loading: pack linear weights for the CPU's GEMM kernels (CPU, bf16; the LM
        head's logits stay float32 where the kernel allows), or fold the norms into the
        projections for decode steps (GPU, ``FOLD_NORMS``)."""
        for kernel, num in pack_linears(self.model, float32_outputs=("lm_head",)).items():
            logger.info("packed %d linear layers for the %s kernel", num, kernel)
            self.packed_weights = True
        num = sum(m.pack() for m in self.model.modules() if isinstance(m, Experts))
        if num:
            self.packed_weights = True
            logger.info("packed the experts of %d layers for the vnni kernel", num)
        if self.lora_limits is not None:
            # The adapters' deltas read each projection's own input (the normed hidden state):
            # no folded norms, no one-call CPU decode.
            self.lora = LoRAManager(
                self.model,
                self.whole_config,
                **self.lora_limits._asdict(),
                max_num_tokens=max(self.max_num_batched_tokens, self.max_num_seqs),
                dtype=self.dtype,
                device=self.device,
                # the Triton kernel with the fused kernels (the torch backend: torch ops alone)
                expand_kernel=LORA_EXPAND_KERNEL
                and self.device.type == "cuda"
                and self.model.fused_rope,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
            )
            logger.info(
                "LoRA: up to %d adapters a step, rank <= %d (no folded norms, GEMV layers or "
                "one-call CPU decode)",
                self.lora.max_loras,
                self.lora.max_lora_rank,
            )
            return
        prompts = FOLD_PROMPTS and getattr(self.backend, "fuses_prompt_norm", False)
        if (
            FOLD_NORMS
            and self.device.type == "cuda"
            and getattr(self.backend, "fuses_decode_norm", False)
            and self.model.fold_norms(prompts=prompts)
        ):
            logger.info(
                "%s steps run with the RMSNorms folded into the projections",
                "all" if prompts else "decode",
            )
        cfg = self.model_config
        decodes_in_place = getattr(self.backend, "decodes_in_place", None)
        if (
            decodes_in_place is not None
            and decodes_in_place(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
            and self.model.use_cpu_decode_layers(load_cpu_ops())
        ):
            logger.info("decode steps run the layers in one C++ call")

    def attach_draft(
        self,
        draft: ModelRunner,
        num_speculative_tokens: int,
        disable_by_batch_size: int | None = None,
    ) -> None:
        """Speculative decoding with a draft model (``runner.draft``): ``draft`` is its runner,
        built as this one (device, dtypes, sizes) and loaded, before the KV cache is sized. It
        shares this runner's request table; each block holds its KV beside this model's."""
        draft.batch = self.batch
        self.draft = DraftProposer(draft, num_speculative_tokens, disable_by_batch_size)

    def kv_bytes_per_block(self) -> int:
        """A block's bytes in the pool (and the draft model's pool, with one)."""
        cfg = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        size = cfg.num_layers * 2 * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        if self.draft is not None:
            size += self.draft.runner.kv_bytes_per_block()
        return size

    @torch.inference_mode()
    def calculate_kv_scales(self, num_tokens: int = 512) -> list[tuple[float, float]]:
        """vLLM's ``--calculate-kv-scales`` for an 8-bit KV cache, before the cache is
        allocated (its scales are fixed in the kernels' launches and CUDA graphs): one prompt
        pass of the model over ``num_tokens`` random tokens (a fixed seed, the same on every
        rank) into a temporary cache in the model's dtype, through the reference backend; each
        layer's scales are then the largest ``|K|`` and ``|V|`` it wrote over vLLM's ranges
        (``KV_SCALE_RANGES``), 1 where they are all zero. Sets and returns them."""
        cfg, bs = self.model_config, self.block_size
        n = max(1, min(num_tokens, self.max_model_len, self.max_num_batched_tokens))
        blocks = -(n // -bs)
        pool = torch.zeros(
            (blocks, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        caches = [KVCacheView(pool[:, layer]) for layer in range(cfg.num_layers)]
        table = torch.arange(blocks, device=self.device).view(1, -1)
        pos = torch.arange(n, device=self.device)
        metadata = AttentionMetadata(
            num_reqs=1,
            num_decodes=0,
            num_tokens=n,
            query_start_loc=[0, n],
            seq_lens=[n],
            block_tables=table,
            slot_block=table[0, pos // bs],
            slot_offset=pos % bs,
            decode_bias=None,
            max_decode_blocks=0,
        )
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=generator).to(self.device)
        backend = create_attention_backend(
            "torch", self.device.type, dtype=self.dtype, head_dim=cfg.head_dim
        )
        self.model(ids, pos, caches, metadata, backend)
        largest = pool.abs().amax(dim=(0, 3, 4, 5)).float().tolist()  # [layer][K, V]
        ranges = KV_SCALE_RANGES
        scales = [
            (k / ranges[0] if k > 0 else 1.0, v / ranges[1] if v > 0 else 1.0) for k, v in largest
        ]
        self.model.set_kv_scales(scales)
        return scales

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the one block-major pool: ``[num_blocks, layers, 2, block_size, kv_heads,
        head_dim]``, so a block's K and V for every layer are contiguous."""
        cfg = self.model_config
        self.kv_pool = torch.zeros(
            (num_blocks, cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        # an 8-bit cache's K and V scales: the checkpoint's (FP8), else 1 (vLLM's defaults)
        scales = self.model.kv_scales() if self.kv_dtype in FP8_KV_DTYPES else None
        self.kv_caches = [
            KVCacheView(self.kv_pool[:, layer], *(scales[layer] if scales else (1.0, 1.0)))
            for layer in range(cfg.num_layers)
        ]
        if self.draft is not None:  # (the same block ids)
            self.draft.runner.initialize_kv_cache(num_blocks)

    def initialize_host_kv_cache(self, num_slots: int) -> None:
        """The host tier's buffer (``--kv-offloading-size``): ``num_slots`` blocks laid out as
        the pool's (this rank's heads), page-locked on a GPU so that the copies run on the
        stream without the host waiting (``kv_cache.host_cache``)."""
        assert self.kv_pool is not None
        shape = (num_slots, *self.kv_pool.shape[1:])
        self.host_kv = torch.empty(shape, dtype=self.kv_pool.dtype)
        if self.device.type == "cuda":
            self._host_kv_lock = _PageLocked(self.host_kv, "the KV tier", "kv_offloading_size")
        if self.draft is not None:  # (a slot holds the draft's KV of its block too)
            self.draft.runner.initialize_host_kv_cache(num_slots)

    def _copy_host_blocks(self, copies: Sequence[KVCopy]) -> None:
        """A step's moves between the pool and the host tier, in order, queued on the stream
        before its forward pass (whose kernels then read the loaded blocks and may overwrite
        the saved ones)."""
        host, pool = self.host_kv, self.kv_pool
        assert host is not None and pool is not None, "no host KV tier"
        for to_host, block_id, slot in copies:
            if to_host:
                host[slot].copy_(pool[block_id], non_blocking=True)
            else:
                pool[block_id].copy_(host[slot], non_blocking=True)
        if self.draft is not None:
            self.draft.runner._copy_host_blocks(copies)

    @torch.inference_mode()
    def load_kv_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write whole blocks of the unsharded model (``[n, layers, 2, block_size, all KV
        heads, head_dim]``, on this device) into the pool at ``block_ids``: this rank's heads
        of them (all of them with one rank)."""
        assert self.kv_pool is not None
        heads = self.model_config.num_kv_heads
        mine = blocks.narrow(4, self.tp_rank * heads, heads)
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        copy_blocks_(self.kv_pool, ids, to_cache_dtype(mine, self.kv_pool.dtype))

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """This rank's heads of the pool's blocks ``block_ids``: ``[n, layers, 2, block_size,
        this rank's KV heads, head_dim]``, a new contiguous tensor."""
        assert self.kv_pool is not None
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv_pool.index_select(0, ids)

    @torch.inference_mode()
    def warmup_kernels(self) -> None:
        """Before serving, after ``initialize_kv_cache``: compile the attention backend's kernel
        variants (GPU backends that JIT-compile per variant), and on a GPU run the LM head once
        at every row count a step can sample. The LM head runs eagerly on the sampled rows
        only; cuBLAS picks its kernel by shape and the CUDA driver loads each kernel on first
        use, which took ~5 ms a new row count on the H200: the first pass of a workload paid
        it in most steps."""
        start = time.perf_counter()
        warmup = getattr(self.backend, "warmup", None)
        if warmup is not None and self.kv_caches:
            bs = self.block_size
            for window, softcap in self.model.attention_options():
                warmup(
                    self.kv_caches[0],
                    self.model_config.num_heads,
                    window=window,
                    softcap=softcap,
                    max_seq_len=-(self.max_model_len // -bs) * bs,  # (the graphs' decode length)
                    dtype=self.dtype,
                )
        if self.device.type == "cuda":
            hidden = torch.zeros(
                (self.max_num_seqs, self.model_config.hidden_size),
                dtype=self.dtype,
                device=self.device,
            )
            for rows in range(1, self.max_num_seqs + 1):
                fused.argmax(self.model.compute_logits(hidden[:rows]))
            # Sampling at a temperature with top-p: its Triton kernel compiles on first use
            # (the first such request paid ~0.5-1 s on the H200).
            rows = min(2, self.max_num_seqs)
            params = [SamplingParams(temperature=1.0, top_p=0.9)] * rows
            metadata = SamplingMetadata.from_params(
                params, [[]] * rows, [[]] * rows, {}, device=self.device
            )
            self.sampler(self.model.compute_logits(hidden[:rows]), metadata)
            self._warm_patch_pending()
            torch.cuda.synchronize()
        logger.info("kernels ready in %.1f s", time.perf_counter() - start)

    def _warm_patch_pending(self) -> None:
        """Launch once each kernel that ``_patch_pending`` uses when a step mixes prompts with
        decodes whose input ids are pending (``index_select`` of the last sampled ids,
        ``index_copy_`` into the inputs), at index counts on both sides of torch's small-index
        cutoff (16): the driver loads a kernel lazily at its first launch, and that load waited
        for the device. The first such step of a Qwen-256 run on the H200 spent 14-20 ms in
        ``index_select`` while the previous prompt step ran (cProfile,
        benchmarks/device/first_mixed.sh); ``CUDA_MODULE_LOADING=EAGER`` removed it."""
        n = max(self.max_num_seqs, 17)
        last = torch.zeros(n, dtype=torch.int64, device=self.device)
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        for count in (1, 17):
            rows = torch.arange(count, device=self.device)
            ids.index_copy_(0, rows, last.index_select(0, rows))

    def enable_decode_graphs(self, capture: bool, num_speculative_tokens: int = 0) -> bool:
        """Run decode-only steps through persistent buffers, from CUDA graphs when ``capture``
        (after ``initialize_kv_cache``); with ``num_speculative_tokens``, the steps of decodes
        and drafts too (a row a token: up to ``max_num_seqs`` times one more than drafts a
        request, within the default capture sizes). Only backends that read
        ``decode_seq_lens`` on the device can; returns whether this one does."""
        if self.backend.name != "triton":
            return False
        self._graph_args["decode"] = (capture, num_speculative_tokens)
        rows = self.max_num_seqs * (1 + num_speculative_tokens)
        self.graphs = DecodeGraphs(
            lambda ids, pos, md: self.model(ids, pos, self.kv_caches, md, self.backend),
            max_batch_size=min(rows, max(self.max_num_seqs, DEFAULT_CAPTURE_SIZES[-1])),
            max_blocks_per_req=-(self.max_model_len // -self.block_size),
            device=self.device,
            capture=capture,
            switch=self._lora_switch(),
        )
        self.graphs.capture_all()
        return True

    def enable_piece_graphs(self, capture: bool) -> bool:
        """Run the steps that decode graphs do not take (prompt chunks, mixed batches) through
        ``PieceGraphs``, captured now when ``capture``: before the KV cache is sized, so that
        their memory is counted as in use. Not for a mixture of experts whose experts run one
        by one, as the routing says (``moe.experts_sorted``), which a graph cannot follow; with
        the Triton experts (``use_triton_experts``) it is. Returns whether the pieces are on."""
        cfg = self.model_config
        layers = [m for m in self.model.modules() if isinstance(m, moe.SparseMoE)]
        if not all(m.triton_experts for m in layers):
            return False
        self._graph_args["pieces"] = (capture, 0)
        q_size = cfg.num_heads * cfg.head_dim
        self.pieces = PieceGraphs(
            self.model,
            hidden_size=cfg.hidden_size,
            qkv_size=q_size + 2 * cfg.num_kv_heads * cfg.head_dim,
            q_size=q_size,
            dtype=self.dtype,
            max_num_tokens=self.max_num_batched_tokens,
            device=self.device,
            capture=capture,
            switch=self._lora_switch(),
        )
        self.pieces.capture_all()
        return True

    def _lora_switch(self) -> Callable[[bool], object] | None:
        """With LoRA adapters, the graphs' switch: whether a step computes the adapters'
        deltas (``LoRABatch.active``). Base-model steps then replay graphs without them."""
        lora = self.lora
        if lora is None:
            return None
        return lambda on: setattr(lora.batch, "active", on)

    def _lora_active(self) -> bool:
        return self.lora is not None and self.lora.batch.active

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs, before a tensor-parallel group is torn down: NCCL's teardown
        waits for the graphs that captured its collectives (it hung on the H200s while they
        lived). Steps still run afterwards, eagerly."""
        for graphs in (self.graphs, self.pieces):
            if graphs is not None:
                graphs.release()
        with contextlib.suppress(RuntimeError):  # a rank is gone: its collectives never end
            self.synchronize()

    def synchronize(self) -> None:
        """Wait for the work queued on the device (``check_ranks`` permitting)."""
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            wait_for(event, self.check_ranks)

    # --- sleep mode ----------------------------------------------------------------------------

    def read_weights_again(self, draft: bool = True) -> None:
        """The checkpoint's weights into the model's tensors again (``reload_weights``, set by
        whoever loaded them), the norms then folded as they were; the draft's too when
        ``draft``. The tensors keep their addresses: the CUDA graphs stay valid."""
        assert self.reload_weights is not None, "no loader to read the weights again"
        assert not self.packed_weights, "packed weights do not load in place"
        self.reload_weights()
        if self.model.folded_norms:  # (the norms read again: fold them as before)
            self.model.fold_norms(prompts=self.model.folded_prompts)
        if draft and self.draft is not None:
            self.draft.runner.read_weights_again()

    def sleep(self, level: int) -> None:
        """Give the device's memory back while the engine is idle (vLLM's sleep mode): the KV
        cache's contents are dropped, the CUDA graphs destroyed (their addresses are gone:
        ``wake_up`` captures them again), and the weights copied to host memory (level 1) or
        dropped (level 2: ``wake_up`` reads them again, ``reload_weights``; vLLM leaves that
        to the caller). Buffers (the rope tables) stay, as in vLLM. On a CPU the weights stay
        where they are at level 1 (host memory already), and at level 2 when packed for the
        CPU's kernels (the checkpoint no longer loads into packed layers). A draft model
        sleeps with the model."""
        assert not self.asleep, "already asleep"
        assert level in (1, 2)
        self.synchronize()
        tensors: list[torch.Tensor] = list(self.model.parameters())
        if level == 1 and self.device.type == "cuda":
            tensors += self.model.buffers()
        elif level == 1 or self.packed_weights:
            tensors = []
        storages = _storages(tensors)
        backups: list[torch.Tensor | None] = [None] * len(storages)
        if level == 2:
            self._host_copy = None  # (level 2 gives the host memory back too)
        if level == 1 and storages:  # (first: a host that cannot lock the copy changes nothing)
            nbytes = sum(storage.nbytes() for storage in storages)
            if self._host_copy is None or self._host_copy.tensor.numel() != nbytes:
                self._host_copy = None  # (the old one unlocked and freed first)
                self._host_copy = _PageLocked(
                    _faulted_in(nbytes), "the weights' copy (sleep level 1)", "sleep at level 2"
                )
            host = self._host_copy.tensor
            offset = 0
            for i, storage in enumerate(storages):
                backup = backups[i] = host[offset : offset + storage.nbytes()]
                backup.copy_(_as_bytes(storage), non_blocking=True)
                offset += storage.nbytes()
            self.synchronize()
        self._weights_backup = [
            (storage, storage.nbytes(), backup)
            for storage, backup in zip(storages, backups, strict=True)
        ]
        for storage in storages:
            storage.resize_(0)
        self.release_graphs()
        self.graphs = self.pieces = None
        self._gathered = None
        self._last_sampled, self._last_sampled_reqs = None, []
        if self.kv_pool is not None:
            self.kv_pool.untyped_storage().resize_(0)
        self.asleep = {"weights", "kv_cache"}
        if self.draft is not None:
            self.draft.runner.sleep(level)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: Iterable[str]) -> None:
        """Take back the memory of the ``tags`` asleep ("weights", "kv_cache"): the weights
        copied back or read again (``reload_weights``, then the norms folded again as they
        were), the KV cache zeroed (its blocks forgotten: the caller's prefix cache is
        empty). Once both are awake, the CUDA graphs are captured again as before."""
        wake = set(tags) & self.asleep
        if "weights" in wake:
            for storage, nbytes, backup in self._weights_backup:
                storage.resize_(nbytes)
                if backup is not None:
                    _as_bytes(storage).copy_(backup, non_blocking=True)
            if any(backup is None for _, _, backup in self._weights_backup):
                self.read_weights_again(draft=False)
            self.synchronize()
            self._weights_backup = []  # (the host copy stays locked for the next sleep)
        if "kv_cache" in wake and self.kv_pool is not None:
            pool = self.kv_pool
            pool.untyped_storage().resize_(pool.numel() * pool.element_size())
            pool.zero_()
        self.asleep -= wake
        if self.draft is not None:
            self.draft.runner.wake_up(wake)
        if wake and not self.asleep:
            if "pieces" in self._graph_args:
                self.enable_piece_graphs(self._graph_args["pieces"][0])
            if "decode" in self._graph_args:
                self.enable_decode_graphs(*self._graph_args["decode"])

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """Peak memory (bytes, beyond what is allocated now) of the largest step: a prefill of
        ``max_num_batched_tokens`` tokens and ``max_num_seqs`` rows of logits. Uses a temporary
        KV pool just large enough, freed afterwards (its bytes are not counted)."""
        cfg, bs = self.model_config, self.block_size
        num_tokens = self.max_num_batched_tokens
        seq_len = min(num_tokens, self.max_model_len)
        lens = [seq_len] * (num_tokens // seq_len) + (
            [num_tokens % seq_len] if num_tokens % seq_len else []
        )
        blocks_per_seq = -(seq_len // -bs)
        pool = torch.zeros(
            (len(lens) * blocks_per_seq, cfg.num_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.kv_dtype,
            device=self.device,
        )
        caches = [KVCacheView(pool[:, layer]) for layer in range(cfg.num_layers)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        table = torch.arange(len(lens) * blocks_per_seq, device=self.device).view(len(lens), -1)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lens])
        row = torch.cat([torch.full((n,), i, device=self.device) for i, n in enumerate(lens)])
        metadata = AttentionMetadata(
            num_reqs=len(lens),
            num_decodes=0,
            num_tokens=num_tokens,
            query_start_loc=[0, *np.cumsum(lens).tolist()],
            seq_lens=lens,
            block_tables=table,
            slot_block=table[row, pos // bs],
            slot_offset=pos % bs,
            decode_bias=None,
            max_decode_blocks=0,
        )
        ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=self.device)
        hidden = self.model(ids, pos, caches, metadata, self.backend)
        rows = min(self.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows]).float()
        logits.softmax(dim=-1)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del pool, caches, hidden, logits
        torch.cuda.empty_cache()
        return int(peak)

    # --- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.launch(so).result()

    def can_run_ahead(self, so: SchedulerOutput) -> bool:
        """Whether ``so`` may be launched while the previous step's tokens are still on the
        device: none of its requests with a pending token needs its tokens on the host
        (penalties, logprobs, bad words, ``min_tokens``)."""
        if not self.batch.num_host_bound:
            return True
        states = self.batch.requests
        for cached in so.scheduled_cached_reqs:
            state = states.get(cached.req_id)
            if state is not None and state.num_pending and not _host_free(state):
                return False
        return True

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput, grammar: GrammarSource | None = None) -> StepHandle:
        """Start one step: its inputs, the forward pass and sampling are queued on the device,
        and the handle's ``result()`` waits for the sampled token ids. A decode whose input
        token is still pending (sampled by the step launched before, not yet reported) takes
        it from that step's device tensor, so the host need not wait between steps.
        ``grammar`` gives what its requests with structured output may sample; it is called
        once the forward pass is queued (and only if the step samples), so that the host fills
        the bitmask while the device computes the logits."""
        self.batch.update(so)
        self._num_launches += 1
        if so.kv_copies:
            self._copy_host_blocks(so.kv_copies)
        if so.is_empty:
            return StepHandle.ready(ModelRunnerOutput({}))
        self.staging.next_step()
        try:
            handle = self._launch(so, grammar)
        finally:
            self.staging.step_launched()
        if self.draft is not None:  # its drafts once the step's tokens are known
            states, draft = self.batch.requests, self.draft
            steps = [(states[r], states[r].num_computed_tokens, n)
                     for r, n in so.num_scheduled_tokens.items()]  # fmt: skip
            handle.then(
                lambda out: dataclasses.replace(out, draft_token_ids=draft.propose(steps, out))
            )
        return handle

    def _launch(self, so: SchedulerOutput, grammar: GrammarSource | None) -> StepHandle:
        states = self.batch.requests
        if grammar is not None and so.spec_token_ids:
            grammar = functools.cache(grammar)  # (the drafts' check and the sampler share it)
        # Decodes first, then fresh prefill chunks by length, then chunks with cached context:
        # the attention backend batches the first two kinds.
        num_sched = so.num_scheduled_tokens
        one_token_each = so.total_num_scheduled_tokens == len(num_sched)
        if one_token_each:  # all count as decodes: any order will do
            order = list(num_sched)
        else:
            order = sorted(
                num_sched,
                key=lambda r: (num_sched[r] != 1, states[r].num_computed_tokens > 0, num_sched[r]),
            )
        gathered, self._gathered = self._gathered, None
        if (
            REUSE_GATHER
            and gathered is not None
            and gathered.launch == self._num_launches - 1
            and one_token_each
        ):
            if gathered.num_removed != self.batch.num_removed or gathered.order != order:
                # requests left since: the rest are the same states if none joined or resumed
                gathered = None if so.scheduled_new_reqs else gathered.fewer(order)
        else:
            gathered = None
        # a steady decode batch, or one that lost requests (_DecodeGather)
        reqs = gathered.reqs if gathered is not None else [states[r] for r in order]
        if so.num_steps > 1:
            return self._launch_steps(so.num_steps, reqs, order, gathered)
        graphs = self.graphs
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        wants_prompt_logprobs = self.batch.num_prompt_logprobs > 0 and any(
            s.wants_prompt_logprobs for s in reqs
        )
        pooled: dict[str, list[float]] = {}
        spec: _SpecCheck | None = None
        pools = self.batch.num_pooling > 0 and any(s.pooling is not None for s in reqs)
        embeds = None
        if self.batch.num_prompt_embeds:
            embeds = self._step_embeds(reqs, [num_sched[r] for r in order])
        if (
            graphs is not None
            and embeds is None
            and one_token_each
            and len(reqs) <= graphs.max_batch_size
            and not wants_prompt_logprobs
            and not pools
        ):
            hidden, sample_rows = self._run_decode_graph(graphs, reqs, order, gathered)
            if len(sample_rows) < len(reqs):
                hidden = hidden[self.staging.to_device(sample_rows, torch.long)]
            logits = self.model.compute_logits(hidden)
        else:
            num_new = [num_sched[r] for r in order]
            drafted = so.spec_token_ids
            # decodes and drafts alone: every token runs as a decode (_prepare_inputs' split)
            split = (
                bool(drafted)
                and not (wants_prompt_logprobs or pools)
                and all(n == 1 or r in drafted for r, n in zip(order, num_new, strict=True))
            )
            if (
                split
                and graphs is not None
                and embeds is None
                and SPLIT_GRAPHS
                and sum(num_new) <= graphs.max_batch_size
            ):
                hidden, sample_rows = self._run_split_graph(graphs, reqs, num_new)
            else:
                input_ids, positions, metadata, sample_rows = self._prepare_inputs(
                    reqs, num_new, split
                )
                hidden = self._forward(input_ids, positions, metadata, embeds)
                if wants_prompt_logprobs:
                    prompt_logprobs = self._prompt_logprobs(reqs, metadata, hidden)
            # each request's first token's row
            starts = list(accumulate(num_new, initial=0))
            last_token = self.staging.to_device(
                [starts[i + 1] - 1 for i in sample_rows], torch.long
            )
            last_hidden = hidden[last_token]
            if pools:
                pooled_rows = last_hidden
                if self.pooler.every_token:
                    pooled_rows = self._pool_rows(reqs, metadata, hidden, sample_rows)
                if self.pooler.classifies:  # the head's logits, one per label
                    pooled_rows = self.model.compute_logits(pooled_rows.to(hidden.dtype))
                pooled = _pool([reqs[i] for i in sample_rows], pooled_rows, self.pooler)
            logits = self.model.compute_logits(last_hidden)
            if drafted:
                spec = self._verify(reqs, order, drafted, starts, hidden, grammar)
        if not sample_rows:
            if spec is None:
                return StepHandle.ready(ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs))
            no_ids = (torch.empty(0, dtype=torch.long), None)
            return StepHandle(
                self.batch, [], no_ids, {}, prompt_logprobs, self.check_ranks, spec=spec
            )
        sampled_reqs = reqs if len(sample_rows) == len(reqs) else [reqs[i] for i in sample_rows]
        logprobs: dict[str, TokenLogprobs] = {}
        if not self.batch.num_not_plain_greedy or all(_plain_greedy(s) for s in sampled_reqs):
            # Nothing to process or report: the argmax alone (what the sampler would return).
            token_ids = fused.argmax(logits)
        else:
            bitmask = grammar() if grammar is not None else None  # (the logits are queued)
            out = self.sampler(logits, self._sampling_metadata(sampled_reqs, bitmask))
            token_ids = out.sampled_token_ids
            if out.logprobs is not None:  # reported per token: read now
                for j, state in enumerate(sampled_reqs):
                    if state.sampling_params.logprobs is None:
                        continue
                    n = 1 + state.sampling_params.logprobs
                    logprobs[state.req_id] = TokenLogprobs(
                        token_ids=out.logprobs.token_ids[j, :n].tolist(),
                        logprobs=out.logprobs.logprobs[j, :n].tolist(),
                        rank=int(out.logprobs.ranks[j]),
                    )
        for state in sampled_reqs:
            state.num_pending += 1
        if self.tp_size > 1:  # every rank continues from rank 0's tokens
            distributed.broadcast(token_ids)
        self._last_sampled = token_ids
        self._last_sampled_reqs = sampled_reqs
        # every request sampled: their ids (and, from a decode graph, rows) are known in order
        mine = self._gathered if sampled_reqs is reqs else None
        return StepHandle(
            self.batch,
            sampled_reqs,
            self._to_host(token_ids),
            logprobs,
            prompt_logprobs,
            self.check_ranks,
            req_ids=order if sampled_reqs is reqs else None,
            rows=mine.rows if mine is not None else None,
            pooled=pooled,
            spec=spec,
        )

    def _verify(
        self,
        reqs: list[CachedRequestState],
        order: list[str],
        spec_token_ids: Mapping[str, list[int]],
        starts: Sequence[int],
        hidden: torch.Tensor,
        grammar: GrammarSource | None,
    ) -> _SpecCheck:
        """Check the drafts of the step's requests that have some (spec_decode): the logits
        at each of their positions (the last token's and every draft's), their argmax or
        their sampling distribution, and which drafts hold, on the device."""
        which = [i for i, req_id in enumerate(order) if req_id in spec_token_ids]
        states = [reqs[i] for i in which]
        drafts = [spec_token_ids[order[i]] for i in which]
        # a request with drafts has exactly its last token and them in the step, from the row
        # ``starts[i]`` on
        rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in which])
        logits = self.model.compute_logits(hidden[self.staging.to_device(rows, torch.long)])
        probs = greedy_rows = metadata = None
        seeds: dict[int, int] = {}  # a seeded random row draws with its token's index's seed
        if all(_plain_greedy(s) for s in states):
            greedy_ids: torch.Tensor | None = fused.argmax(logits)
        else:
            params: list[SamplingParams] = []
            prompts: list[list[int]] = []
            outputs: list[list[int]] = []  # each row's output so far: the drafts before it too
            for state, ahead in zip(states, drafts, strict=True):
                sp = state.sampling_params
                if state.seed is not None:
                    index = _next_index(state)
                    for j in range(len(ahead) + 1):
                        seeds[len(params) + j] = draw_seed(state.seed, index + j)
                params += [sp] * (len(ahead) + 1)
                if state.host_free:  # (nothing reads the tokens)
                    prompts += [[]] * (len(ahead) + 1)
                    outputs += [[]] * (len(ahead) + 1)
                    continue
                out = self.batch.output_token_ids(state)
                prompts += [state.prompt_token_ids] * (len(ahead) + 1)
                outputs += [out + ahead[:j] for j in range(len(ahead) + 1)]
            masks = self._draft_masks(states, drafts, grammar)
            metadata = SamplingMetadata.from_params(
                params,
                prompts,
                outputs,
                seeds,
                grammar_bitmask=masks[0] if masks else None,
                grammar_rows=masks[1] if masks else (),
                device=self.device,
            )
            greedy_ids, probs, greedy_rows = self.sampler.distribution(logits, metadata)
            seeds = metadata.seeds
        _, rows_of_drafts = draft_rows([len(d) for d in drafts])
        # (staged: a copy from pageable memory would wait for the forward pass)
        draft_ids = self.staging.to_device([t for d in drafts for t in d], torch.long)
        draft_index = self.staging.to_device(rows_of_drafts, torch.long)
        accept, target = verify(draft_ids, draft_index, greedy_ids, probs, greedy_rows, seeds)
        outcome = torch.cat([accept.long(), target])
        if self.tp_size > 1:  # every rank keeps rank 0's tokens
            distributed.broadcast(outcome)
        for state in states:
            state.num_pending += 1
        logprobs = None
        wanted = [
            s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None
        ]
        if wanted:
            # the token each row keeps if it is kept: its draft if accepted, else the target
            kept = target.clone()
            kept[draft_index] = torch.where(accept, draft_ids, target[draft_index])
            assert metadata is not None  # (a row with logprobs is not plain greedy)
            # each position's as the sampler reports them (the model's own by default)
            reported = self.sampler.reported(logits, metadata)
            logprobs = compute_logprobs(reported, kept, max(wanted))
        return _SpecCheck(states, drafts, outcome, logprobs)

    @staticmethod
    def _draft_masks(
        states: list[CachedRequestState], drafts: list[list[int]], grammar: GrammarSource | None
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar bitmask of a step's drafts' rows (the rows of a request with structured
        output: its own and one after each draft, EngineCore._grammar_bitmask) and which rows
        have one; None when none has a grammar."""
        if grammar is None or all(s.sampling_params.structured_outputs is None for s in states):
            return None
        source = grammar()
        if source is None:
            return None
        where: list[int] = []  # the check's rows with a grammar
        rows: list[int] = []  # their rows of the step's bitmask
        row = 0
        for state, ahead in zip(states, drafts, strict=True):
            first = source.rows.get(state.req_id)
            if first is not None:
                where += range(row, row + len(ahead) + 1)
                rows += range(first, first + len(ahead) + 1)
            row += len(ahead) + 1
        bitmask = torch.full((row, source.bitmask.shape[1]), -1, dtype=torch.int32)
        bitmask[torch.tensor(where, dtype=torch.int64)] = source.bitmask[
            torch.tensor(rows, dtype=torch.int64)
        ]
        return bitmask, where

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states of a step that runs no decode graph: piecewise graphs where a size
        was captured, else the eager model (always with prompt ``embeds``, ``_step_embeds``)."""
        pieces = self.pieces
        hidden: torch.Tensor
        if embeds is not None:
            hidden = self.model(
                input_ids, positions, self.kv_caches, metadata, self.backend, prompt_embeds=embeds
            )
            return hidden
        if pieces is not None and pieces.padded_size(metadata.num_tokens) is not None:
            hidden = pieces.run(
                input_ids,
                positions,
                self.kv_caches,
                metadata,
                self.backend,
                switch_on=self._lora_active(),
            )
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, metadata, self.backend)
        return hidden

    def _step_embeds(
        self, reqs: list[CachedRequestState], num_new: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's token rows whose inputs are prompt embeddings and those rows' values
        (None if it has none): the positions of the step's chunks of such prompts."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        first = 0  # the request's first token row in the step
        for state, n in zip(reqs, num_new, strict=True):
            start = state.num_computed_tokens
            end = min(start + n, len(state.prompt_token_ids))
            if state.prompt_embeds is not None and start < end:
                rows.append(torch.arange(first, first + end - start))
                values.append(state.prompt_embeds[start:end])
            first += n
        if not rows:
            return None
        index = torch.cat(rows).to(self.device, non_blocking=True)
        return index, torch.cat(values)

    def _launch_steps(
        self,
        num_steps: int,
        reqs: list[CachedRequestState],
        order: list[str],
        gathered: _DecodeGather | None,
    ) -> StepHandle:
        """A multi-step (``SchedulerOutput.num_steps``): ``num_steps`` decode passes over
        ``reqs``, pass ``j`` computing each one's position ``c + j`` from the token pass
        ``j - 1`` sampled, which stays on the device (``_patch_pending``). The host reads every
        pass's tokens at the end, in one copy. The scheduler sends only requests whose sampling
        reads none of their tokens on the host."""
        n = len(reqs)
        graphs = self.graphs
        if graphs is not None and n > graphs.max_batch_size:
            graphs = None  # (eager passes)
        greedy = not self.batch.num_not_plain_greedy or all(_plain_greedy(s) for s in reqs)
        metadata = None if greedy else self._sampling_metadata(reqs)
        seeded = _seeded(reqs) if metadata is not None else []
        passes: list[torch.Tensor] = []
        for j in range(num_steps):
            if j:
                for state in reqs:
                    state.num_computed_tokens += 1
                if metadata is not None and seeded:  # (each pass draws the next token)
                    seeds = {i: draw_seed(seed, n + j) for i, seed, n in seeded}
                    metadata = dataclasses.replace(metadata, seeds=seeds)
            if graphs is not None:
                hidden, sample_rows = self._run_decode_graph(
                    graphs, reqs, order, gathered, span=num_steps - j, later_pass=j > 0
                )
                gathered = self._gathered
            else:  # (the inputs count this pass's pending tokens: num_pending below)
                input_ids, positions, md, sample_rows = self._prepare_inputs(reqs, [1] * n)
                hidden = self._forward(input_ids, positions, md)[:n]
            assert len(sample_rows) == n, "each pass of a multi-step samples every request"
            logits = self.model.compute_logits(hidden)
            if metadata is None:
                token_ids = fused.argmax(logits)
            else:
                token_ids = self.sampler(logits, metadata).sampled_token_ids
            if self.tp_size > 1:
                distributed.broadcast(token_ids)
            if graphs is None:
                for state in reqs:
                    state.num_pending += 1
            self._last_sampled, self._last_sampled_reqs = token_ids, reqs
            passes.append(token_ids)
        if graphs is not None:
            for state in reqs:
                state.num_pending += num_steps
        mine = self._gathered if graphs is not None else None
        return StepHandle(
            self.batch,
            reqs,
            self._to_host(torch.stack(passes, dim=1).view(-1)),  # request-major
            {},
            {},
            self.check_ranks,
            req_ids=order,
            rows=mine.rows if mine is not None else None,
            num_steps=num_steps,
        )

    def _to_host(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying the sampled ids to the host (pinned, alternating between two buffers:
        one step's copy may still be unread while the next is launched)."""
        if self.device.type != "cuda":
            return token_ids, None
        n = token_ids.shape[0]
        self._host_flip ^= 1
        host = self._host_ids[self._host_flip][:n]
        host.copy_(token_ids, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return host, event

    def _patch_pending(
        self,
        reqs: list[CachedRequestState],
        positions: np.ndarray,
        ids: torch.Tensor,
        first: np.ndarray | None = None,
    ) -> None:
        """Fill the input ids (``ids``, on the device, one per token of the step) of decodes
        whose input token is still pending, from the last launched step's sampled ids. Row
        ``first[i]`` (default ``i``) is request ``i``'s first token, at ``positions[i]``: its
        input is pending when the host has the request's tokens only up to that position (then
        it is the last token that step sampled: one of a multi-step's passes, the one before;
        drafts may follow it)."""
        last = self._last_sampled
        if last is None:
            return
        n = len(reqs)
        num_host = np.fromiter((s.num_tokens for s in reqs), dtype=np.int64, count=n)
        dst = np.flatnonzero(positions[:n] >= num_host)
        if not len(dst):
            return
        last_reqs = self._last_sampled_reqs
        if first is not None and first[n - 1] != n - 1:
            rows = first[dst]  # (some request has several tokens: drafts)
        else:
            rows = dst  # row i: request i's first token
            if len(dst) == n and len(last_reqs) >= n and last_reqs[:n] == reqs:
                ids[:n].copy_(last[:n])  # the usual decode batch: same requests, same order
                return
        index = {s.req_id: j for j, s in enumerate(last_reqs)}
        src = [index[reqs[i].req_id] for i in dst.tolist()]
        where = self.staging.to_device(rows, torch.long)
        which = self.staging.to_device(src, torch.long)
        ids.index_copy_(0, where, last.index_select(0, which))

    def _pool_rows(
        self,
        reqs: list[CachedRequestState],
        metadata: AttentionMetadata,
        hidden: torch.Tensor,
        sample_rows: list[int],
    ) -> torch.Tensor:
        """MEAN / CLS pooling: fold this step's prompt rows of every embedding request into its
        ``pooled_rows`` (a chunk from position 0 starts over: a first chunk, or a recompute
        after preemption); the pooled rows ``[len(sample_rows), hidden]`` of the requests whose
        prompt ends in this step (zeros for others among ``sample_rows``)."""
        qsl = metadata.query_start_loc
        mean = self.pooler.pooling_type == "MEAN"
        for i, state in enumerate(reqs):
            if state.pooling is None:
                continue
            rows = hidden[qsl[i] : qsl[i + 1]]
            if state.num_computed_tokens == 0:
                state.pooled_rows = rows.float().sum(0) if mean else rows[0].float()
            elif mean:
                assert state.pooled_rows is not None
                state.pooled_rows += rows.float().sum(0)
        out = torch.zeros(len(sample_rows), hidden.shape[1], device=hidden.device)
        for j, i in enumerate(sample_rows):
            state = reqs[i]
            if state.pooling is not None and state.pooled_rows is not None:
                n = len(state.prompt_token_ids) if mean else 1
                out[j] = state.pooled_rows / n
        return out

    def _prompt_logprobs(
        self, reqs: list[CachedRequestState], md: AttentionMetadata, hidden: torch.Tensor
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """For each request asking for prompt logprobs, the logprobs of the prompt tokens its
        chunk this step predicts: position ``p`` predicts prompt token ``p + 1``."""
        out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
        for i, state in enumerate(reqs):
            num = state.sampling_params.prompt_logprobs
            if num is None:
                continue
            start = md.seq_lens[i] - md.query_len(i)  # first position computed this step
            end = min(md.seq_lens[i], len(state.prompt_token_ids) - 1)  # positions < end
            if start >= end:
                continue
            rows = hidden[md.query_start_loc[i] : md.query_start_loc[i] + end - start]
            raw = self.model.compute_logits(rows).float().log_softmax(dim=-1)
            targets = torch.tensor(
                state.prompt_token_ids[start + 1 : end + 1], dtype=torch.long, device=self.device
            )
            lp = compute_logprobs(raw, targets, num)
            ids, values, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
            out[state.req_id] = (
                start + 1,
                [TokenLogprobs(t, v, int(r)) for t, v, r in zip(ids, values, ranks, strict=True)],
            )
        return out

    def _run_decode_graph(
        self,
        graphs: DecodeGraphs,
        reqs: list[CachedRequestState],
        order: list[str],
        gathered: _DecodeGather | None,
        span: int = 1,
        later_pass: bool = False,
    ) -> tuple[torch.Tensor, list[int]]:
        """One token per request through the captured graphs: hidden states, rows to sample.
        ``gathered``: the previous launch's, of the same requests (a steady decode batch).
        A multi-step's first pass copies the block tables for all ``span`` passes; a later
        pass (``later_pass``: ``gathered`` is the pass before) copies none and takes every
        input token from the pass before."""
        bs = self.block_size
        n = len(reqs)
        if gathered is not None:
            rows, pos = gathered.rows, gathered.pos + 1
            if pos[0] != reqs[0].num_computed_tokens or pos[-1] != reqs[-1].num_computed_tokens:
                gathered = None  # (not expected: a guard on the reasoning above)
            else:
                self.num_steady_launches += 1
        if gathered is None:
            rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=n)
            pos = np.fromiter((s.num_computed_tokens for s in reqs), dtype=np.int64, count=n)
        block_table = self.batch.block_table
        if later_pass:
            table = None
            last = self._last_sampled
            assert last is not None
            patch: Callable[[torch.Tensor], object] = lambda ids: ids.copy_(last)  # noqa: E731
            input_ids = pos  # (every row patched)
        else:
            table = block_table[rows, : (int(pos.max()) + span - 1) // bs + 1]
            patch = lambda ids: self._patch_pending(reqs, pos, ids)  # noqa: E731
            input_ids = self.batch.token_table[rows, pos]
        if self.lora is not None:
            names = [s.lora_name for s in reqs] if self.batch.num_lora else []
            self.lora.set_batch(names, np.ones(n, dtype=np.int64), self.staging)
        hidden = graphs.run(
            input_ids=input_ids,
            positions=pos,
            block_tables=table,
            slot_block=block_table[rows, pos // bs],
            slot_offset=pos % bs,
            patch=patch,
            host=lambda a: self.staging.host(a, torch.int64),
            switch_on=self._lora_active(),
        )
        if gathered is not None and gathered.all_sampled:
            sample_rows = list(range(n))
        else:
            known = np.fromiter(
                (s.num_tokens + s.num_pending for s in reqs), dtype=np.int64, count=n
            )
            sample_rows = np.flatnonzero(pos + 1 == known).tolist()
        self._gathered = _DecodeGather(
            self._num_launches, order, self.batch.num_removed, reqs, rows, pos,
            len(sample_rows) == n,
        )  # fmt: skip
        return hidden, sample_rows

    def _run_split_graph(
        self,
        graphs: DecodeGraphs,
        reqs: list[CachedRequestState],
        num_new: Sequence[int],
        starts: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """A step of decodes and drafts through the decode graphs, every token a row of its
        own (``_prepare_inputs``' split): hidden states, the requests that sample (the ones
        without drafts). The graphs write every row's K/V in a layer before any row attends,
        so a draft's row sees the drafts before it. A request's pending token (async
        scheduling) is patched in from the step before's samples. ``starts``: each request's
        first position (default: its computed tokens)."""
        bs = self.block_size
        counts = np.asarray(num_new, dtype=np.int64)
        if starts is None:
            starts = np.fromiter(
                (s.num_computed_tokens for s in reqs), dtype=np.int64, count=len(reqs)
            )
        rows = np.repeat(
            np.fromiter((s.row for s in reqs), dtype=np.int64, count=len(reqs)), counts
        )
        num_tokens = len(rows)
        first = np.cumsum(counts) - counts  # each request's first token
        pos = np.repeat(starts - first, counts) + self._arange[:num_tokens]
        block_table = self.batch.block_table
        if self.lora is not None:
            names = [s.lora_name for s in reqs] if self.batch.num_lora else []
            self.lora.set_batch(names, counts, self.staging)
        patch = None
        if any(s.num_pending for s in reqs):  # (async scheduling: a decode's input)
            patch = lambda ids: self._patch_pending(reqs, starts, ids, first)  # noqa: E731
        hidden = graphs.run(
            input_ids=self.batch.token_table[rows, pos],
            positions=pos,
            block_tables=block_table[rows, : int(pos.max()) // bs + 1],
            slot_block=block_table[rows, pos // bs],
            slot_offset=pos % bs,
            patch=patch,
            host=lambda a: self.staging.host(a, torch.int64),
            switch_on=self._lora_active(),
        )
        known = [s.num_tokens + s.num_pending for s in reqs]
        ends = (starts + counts).tolist()
        return hidden, [i for i, end in enumerate(ends) if end == known[i]]

    def _prepare_inputs(
        self,
        reqs: list[CachedRequestState],
        num_new: list[int],
        split: bool = False,
        starts: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """The step's inputs and attention metadata, and which requests sample (the last chunk
        of a prompt, a decode). ``split``: every token is a one-token query of its own (a
        decode of its request's table up to its position), as a request's drafts are checked:
        the decode kernels then run them (the C++ decode layers on CPUs), the KV of a row's
        earlier drafts written in each layer before any row attends. ``starts``: each
        request's first position (default: its computed tokens)."""
        bs = self.block_size
        num_reqs = len(reqs)
        rows = np.fromiter((s.row for s in reqs), dtype=np.int64, count=num_reqs)
        if starts is None:
            starts = np.fromiter(
                (s.num_computed_tokens for s in reqs), dtype=np.int64, count=num_reqs
            )
        counts = np.asarray(num_new, dtype=np.int64)
        ends = starts + counts
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(counts, out=cu[1:])
        num_tokens = int(cu[-1])
        # position of token j of request i: starts[i] + (j - cu[i]), for all tokens at once
        pos = self._positions[:num_tokens]
        np.subtract(self._arange[:num_tokens], np.repeat(cu[:-1] - starts, counts), out=pos)
        token_rows = np.repeat(rows, counts)
        input_ids = self._input_ids[:num_tokens]
        input_ids[:] = self.batch.token_table[token_rows, pos]
        # the last chunk of a prompt (or a decode): its last logits are sampled
        seq_lens = ends.tolist()
        known = [s.num_tokens + s.num_pending for s in reqs]
        sample_rows = [i for i, end in enumerate(seq_lens) if end == known[i]]
        q_rows, q_ends, q_cu = rows, ends, cu  # the queries: one a request
        num_decodes = int(np.count_nonzero(counts == 1))
        if split:  # one a token
            q_rows, q_ends, q_cu = token_rows, pos + 1, np.arange(num_tokens + 1, dtype=np.int64)
            num_decodes = num_tokens
            seq_lens = q_ends.tolist()
        query_start_loc = q_cu.tolist()
        max_blocks = -(max(seq_lens) // -bs)
        stage = self.staging.to_device
        table = stage(self.batch.block_table[q_rows, :max_blocks], torch.int64)
        slot_block = stage(self.batch.block_table[token_rows, pos // bs], torch.int64)
        slot_offset = stage(pos % bs, torch.int64)
        decode_bias = None
        decode_lens = None
        max_decode_blocks = 0
        triton = self.backend.name == "triton"
        if num_decodes and triton:
            # The Triton kernels read the lengths; the others may fall back to the masked
            # reference.
            max_decode_blocks = -(max(seq_lens[:num_decodes]) // -bs)
            decode_lens = stage(q_ends[:num_decodes], torch.int64)
        elif num_decodes:
            max_decode_blocks = -(max(seq_lens[:num_decodes]) // -bs)
            lens = decode_lens = torch.tensor(seq_lens[:num_decodes])
            invalid = torch.arange(max_decode_blocks * bs)[None, :] >= lens[:, None]
            decode_bias = torch.zeros(invalid.shape, dtype=self.dtype).masked_fill_(
                invalid, float("-inf")
            )
            decode_bias = decode_bias.view(num_decodes, 1, 1, -1).to(self.device)
            decode_lens = decode_lens.to(self.device)
        metadata = AttentionMetadata(
            num_reqs=len(seq_lens),
            num_decodes=num_decodes,
            num_tokens=num_tokens,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=table,
            slot_block=slot_block,
            slot_offset=slot_offset,
            decode_bias=decode_bias,
            max_decode_blocks=max_decode_blocks,
            decode_seq_lens=decode_lens,
            # the Triton kernels' int32 offsets and lengths, staged with the rest
            query_start_loc_tensor=stage(q_cu, torch.int32) if triton else None,
            seq_lens_tensor=stage(q_ends, torch.int32) if triton else None,
        )
        if self.lora is not None:
            names = [s.lora_name for s in reqs] if self.batch.num_lora else []
            self.lora.set_batch(names, counts, self.staging)
        ids = stage(input_ids, torch.int64)
        if any(s.num_pending for s in reqs):
            # a pending request runs a decode (with drafts after it, under async scheduling)
            self._patch_pending(reqs, starts, ids, cu[:-1])
        return ids, stage(pos, torch.int64), metadata, sample_rows

    def _sampling_metadata(
        self, reqs: list[CachedRequestState], grammar: GrammarBitmask | None = None
    ) -> SamplingMetadata:
        eos = self.model_config.eos_token_ids
        suppressed: list[list[int]] = []
        for s in reqs:
            sp = s.sampling_params
            # a grammar decides when its output may end (min_tokens below it would leave
            # nothing to sample once it allows only the end)
            below_min = s.num_output_tokens < sp.min_tokens and sp.structured_outputs is None
            suppressed.append([*eos, *sp.stop_token_ids] if below_min else [])
        bitmask = None
        rows: list[int] = []
        if grammar is not None:
            # one gather of the grammar rows into the batch's order (a copy per row cost ~10 us
            # on the H200's host: 2.5 ms a step at 256 constrained requests)
            where = [grammar.rows.get(s.req_id) for s in reqs]
            rows = [i for i, row in enumerate(where) if row is not None]
            if where == list(range(len(reqs))) and grammar.bitmask.shape[0] == len(reqs):
                bitmask = grammar.bitmask  # already in the batch's order
            elif rows:
                bitmask = torch.full((len(reqs), grammar.bitmask.shape[1]), -1, dtype=torch.int32)
                source = torch.tensor([where[i] for i in rows], dtype=torch.int64)
                bitmask[torch.tensor(rows, dtype=torch.int64)] = grammar.bitmask[source]
        return SamplingMetadata.from_params(
            [s.sampling_params for s in reqs],
            prompt_token_ids=[s.prompt_token_ids for s in reqs],
            output_token_ids=[self.batch.output_token_ids(s) for s in reqs],
            seeds={i: draw_seed(seed, n) for i, seed, n in _seeded(reqs)},
            suppressed_token_ids=suppressed,
            grammar_bitmask=bitmask if rows else None,
            grammar_rows=rows,
            processors=self._processors(reqs),
            device=self.device,
        )

    def _processors(
        self, reqs: list[CachedRequestState]
    ) -> Callable[[torch.Tensor, bool], torch.Tensor] | None:
        """The custom logits processors of a step sampling ``reqs`` (told of the requests held
        now), as ``SamplingMetadata.processors``; None when none are loaded."""
        processors = self.logits_processors
        if processors is None:
            return None
        processors.update(self.batch.requests, self.batch.live_output_token_ids)
        return functools.partial(processors.apply, [s.req_id for s in reqs])


def _faulted_in(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory, its pages faulted in by several threads at once: one thread
    faults in ~2.5 GB/s, so ``cudaHostAlloc`` took 6.5 s for 15 GiB on the H100s' hosts,
    against 0.7 s to fault them in with 16 threads and 0.9 s to lock them then
    (``benchmarks/device/pin_register.py``)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    parts = host.chunk(max(1, min(16, os.cpu_count() or 1)))
    workers = [threading.Thread(target=part.zero_) for part in parts]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return host


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under ``tensors`` (tied weights, views: one each)."""
    found: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes():
            found.setdefault(storage.data_ptr(), storage)
    return list(found.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _PageLocked:
    """A host tensor's own bytes page-locked in place (``cudaHostRegister``), so that copies
    between it and a GPU run asynchronously on the stream. (torch's pinned allocator rounds each
    allocation up to a power of two: a 9 GiB tier would lock 16.) Unlocked when this is
    collected; it holds the tensor, whose memory is freed only after that."""

    def __init__(self, tensor: torch.Tensor, what: str, remedy: str) -> None:
        self.tensor = tensor
        size = tensor.numel() * tensor.element_size()
        error = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), size, 0))  # type: ignore[no-untyped-call]
        if error:
            raise InvalidRequestError(
                f"cannot page-lock {size / 2**30:.1f} GiB of host memory for {what} (CUDA "
                f"error {error}): {remedy}"
            )

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit CUDA may be gone)
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())  # type: ignore[no-untyped-call]


def wait_for(event: torch.cuda.Event, check: Callable[[], None] | None) -> None:
    """``event.synchronize()``; with ``check``, a poll that calls it until the event is done."""
    if check is None:
        event.synchronize()
        return
    while not event.query():  # type: ignore[no-untyped-call]
        check()
        time.sleep(_POLL_S)


def _pool(
    states: list[CachedRequestState], pooled_rows: torch.Tensor, pooler: PoolerConfig
) -> dict[str, list[float]]:
    """The embeddings of the requests among ``states`` that pool: each one's row of
    ``pooled_rows`` (its prompt's final hidden states, after the last norm, pooled by
    ``pooler``), in float32, cut to its ``dimensions`` and L2-normalized unless it or the
    pooler asks not to be; a classifier's rows (its head's logits) become probabilities
    unless the request asks for the logits. Read to the host now (a sync: embedding steps are
    prefill steps, which wait for little else)."""
    rows = [i for i, s in enumerate(states) if s.pooling is not None]
    vectors = pooled_rows[rows].float().cpu()
    out: dict[str, list[float]] = {}
    for vector, i in zip(vectors, rows, strict=True):
        params = states[i].pooling
        assert params is not None
        if pooler.classifies:
            if params.activation is not False:
                sigmoid = pooler.activation == "sigmoid"
                vector = vector.sigmoid() if sigmoid else vector.softmax(dim=0)
        else:
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if params.normalize if params.normalize is not None else pooler.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
        out[states[i].req_id] = vector.tolist()
    return out


class StepHandle:
    """A launched step. ``result()`` waits for its sampled token ids, records them in the
    runner's request state (unless the request was dropped meanwhile) and returns the output."""

    def __init__(
        self,
        batch: InputBatch,
        sampled_reqs: list[CachedRequestState],
        host: tuple[torch.Tensor, torch.cuda.Event | None],
        logprobs: dict[str, TokenLogprobs],
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]],
        check_ranks: Callable[[], None] | None = None,
        *,
        req_ids: list[str] | None = None,
        rows: np.ndarray | None = None,
        num_steps: int = 1,
        pooled: dict[str, list[float]] | None = None,
        spec: _SpecCheck | None = None,
    ) -> None:
        """``req_ids`` / ``rows``: the ids and table rows of ``sampled_reqs`` in order, where
        the launch had them at hand. ``num_steps``: a multi-step's passes (the host ids hold
        each request's tokens in a row). ``pooled``: embeddings finished this step. ``spec``:
        the drafts checked, of requests not among ``sampled_reqs``."""
        self._batch = batch
        self._num_steps = num_steps
        self._req_ids = req_ids
        self._rows = rows
        self._num_removed = batch.num_removed  # (the step's requests are all held now)
        self._check_ranks = check_ranks
        self._reqs = sampled_reqs
        self._host = host
        self._logprobs = logprobs
        self._prompt_logprobs = prompt_logprobs
        self._pooled = pooled or {}
        self._spec = spec
        self._output: ModelRunnerOutput | None = None
        self._then: Callable[[ModelRunnerOutput], ModelRunnerOutput] | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> StepHandle:
        handle = cls.__new__(cls)
        handle._output = output
        handle._then = None
        return handle

    def then(self, finish: Callable[[ModelRunnerOutput], ModelRunnerOutput]) -> None:
        """Have ``result()`` return ``finish`` of the output (called once, after the step's
        tokens are recorded)."""
        self._then = finish

    def result(self) -> ModelRunnerOutput:
        output = self._collect()
        finish, self._then = self._then, None
        if finish is not None:
            output = self._output = finish(output)
        return output

    def _collect(self) -> ModelRunnerOutput:
        if self._output is not None:
            return self._output
        ids, event = self._host
        if event is not None:
            wait_for(event, self._check_ranks)
        reqs = self._reqs
        req_ids = self._req_ids if self._req_ids is not None else [s.req_id for s in reqs]
        k = self._num_steps
        if k > 1:
            passes = ids.view(len(reqs), k).numpy()
            self._batch.record_sampled(reqs, passes, self._num_removed, self._rows)
            step_tokens = dict(zip(req_ids, passes.tolist(), strict=True))
            self._output = ModelRunnerOutput({}, step_token_ids=step_tokens)
            return self._output
        token_ids = ids.tolist()
        sampled = dict(zip(req_ids, token_ids, strict=True))
        self._batch.record_sampled(reqs, token_ids, self._num_removed, self._rows)
        spec_tokens: dict[str, list[int]] = {}
        spec_logprobs: dict[str, list[TokenLogprobs]] = {}
        if self._spec is not None:
            states = self._spec.states
            tokens, spec_logprobs = self._spec.tokens()
            self._batch.record_spec(states, tokens, self._num_removed)
            spec_tokens = {s.req_id: t for s, t in zip(states, tokens, strict=True)}
        self._output = ModelRunnerOutput(
            sampled,
            self._logprobs,
            self._prompt_logprobs,
            pooled=self._pooled,
            spec_token_ids=spec_tokens,
            spec_logprobs=spec_logprobs,
        )
        return self._output

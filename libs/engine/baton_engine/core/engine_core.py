"""EngineCore: the step loop shared by the offline API and the workers. Token ids in, token ids
out; no tokenizer, no text."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from baton_engine import distributed, logits_processor
from baton_engine import prompt_embeds as embeds
from baton_engine.config import EngineConfig, ModelConfig, SpeculativeConfig, parse_dtype
from baton_engine.core import gpu_lock
from baton_engine.core.outputs import EngineCoreOutput, GrammarBitmask, KVLoad, SchedulerOutput
from baton_engine.core.scheduler import Scheduler
from baton_engine.errors import (
    EngineBusyError,
    EngineSleepingError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
)
from baton_engine.kv_cache import KVCacheManager
from baton_engine.kv_cache.block_pool import KVCacheEvent
from baton_engine.lora import LoRALimits, LoRARequest, lora_requests
from baton_engine.model_files import load_named_tokenizer, load_tokenizer
from baton_engine.model_loader import (
    dequantized_fp8,
    dequantized_int,
    iter_weights,
    resolve_model,
)
from baton_engine.models.llama import FP8_LINEAR, shard_config
from baton_engine.pooling_params import PoolerConfig, PoolingParams
from baton_engine.profiler import StepProfiler
from baton_engine.request import Request, RequestStatus
from baton_engine.runner.model_runner import ModelRunner, StepHandle
from baton_engine.sampling_params import SamplingParams
from baton_engine.structured_output import Grammar, StructuredOutputManager
from baton_kernels.attention.base import FP8_KV_DTYPES, copy_blocks_
from baton_kernels.fp8_linear import fp8_gemm_supported

logger = logging.getLogger(__name__)
# What an embedding request samples after its prompt (the argmax, dropped): a plain greedy
# token keeps the step's fast paths.
_EMBEDDING_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)

_DEFAULT_CPU_KV_BYTES = 2 << 30
_DEFAULT_MAX_MODEL_LEN = 8192
_GC_THRESHOLDS = (50_000, 50, 100)  # cyclic GC generations 0/1/2 (Python's defaults: 700, 10, 10)
# Idle invariant checks walk the whole block pool up to this size (~4 ms on the dev CPU), and
# only the blocks in use beyond it (see ``EngineCore.check_invariants``).
_FULL_CHECK_MAX_BLOCKS = 32_768


class _KVExport:
    """Whole-head KV blocks of prefilled prompts, for a prefill engine split across ranks
    (``EngineCore.enable_kv_export``): rows of ``pool``, free or held by a request until
    ``release_held``, and the prefilled outputs waiting for room."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self.free = list(range(pool.shape[0]))
        self.held: dict[str, list[int]] = {}
        self.pending: list[EngineCoreOutput] = []

    def has_room_for_next(self) -> bool:
        return bool(self.pending) and len(self.pending[0].kv_block_ids or ()) <= len(self.free)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    num_prefix_queries: int  # tokens
    num_prefix_hits: int  # tokens
    num_preemptions: int
    num_prompt_tokens: int  # prompt tokens received (prefix hits included)
    num_generated_tokens: int
    # speculative decoding (vLLM's spec_decode metrics): steps of a request with drafts, its
    # drafts, those accepted, and those accepted at each draft position
    num_spec_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_per_pos: tuple[int, ...] = ()
    # the host KV tier (vLLM's external prefix cache): tokens looked up, and found there
    num_host_queries: int = 0
    num_host_hits: int = 0


def resolve_dtype(config: EngineConfig, model_config: ModelConfig) -> torch.dtype:
    if config.dtype != "auto":
        return parse_dtype(config.dtype)
    native = parse_dtype(model_config.torch_dtype) if model_config.torch_dtype else torch.float32
    if native in (torch.float16, torch.bfloat16) and config.device == "cpu":
        from baton_kernels.cpu_linear import onednn_bf16_available

        if not onednn_bf16_available():
            # no AVX512: bf16 linear layers ran 10x slower than float32 on an AVX2-only EPYC
            logger.warning("this CPU has no fast bf16 matmul (AVX512): running in float32")
            return torch.float32
        return torch.bfloat16  # fp16 matmuls are slow on CPUs; bf16 keeps the range
    return native


def resolve_kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for a model run in ``dtype`` (``EngineConfig.kv_cache_dtype``)."""
    name = config.kv_cache_dtype
    if name == "auto":
        return dtype
    if name == "bfloat16":
        if dtype != torch.bfloat16:
            raise InvalidRequestError(
                f"kv_cache_dtype bfloat16 needs a bfloat16 model, this one runs in {dtype} "
                "(use --kv-cache-dtype auto, or --dtype bfloat16)"
            )
        return dtype
    return torch.float8_e5m2 if name == "fp8_e5m2" else torch.float8_e4m3fn


def _fp8_layer(key: str) -> bool:
    """Whether a checkpoint's ``key.weight`` is one of the model's FP8 layers' weights."""
    return FP8_LINEAR.search(key) is not None


# vLLM's --quantization names for the integer checkpoints (ModelConfig.int_weights)
_INT_METHODS = {"compressed-tensors": "compressed-tensors", "awq": "awq", "awq_marlin": "awq"}


def int_linear_layout(mc: ModelConfig, device: str) -> tuple[int, int | None] | None:
    """(bits, group size) of the packed integer layers the projections are, or None where an
    integer checkpoint's weights are dequantized on load (or the model has none).

    They stay packed (``IntLinear``) on GPUs and are dequantized on load on CPUs (whose bf16
    kernels are faster); ``BATON_PACKED_INT_WEIGHTS=1`` keeps them packed everywhere (a
    quarter of the memory at 4 bits, each product unpacking its weight), ``=0`` dequantizes
    them everywhere."""
    packed = os.environ.get("BATON_PACKED_INT_WEIGHTS")
    if not mc.int_weights or not mc.int_bits or packed == "0":
        return None
    if packed != "1" and not device.startswith("cuda"):
        return None
    return mc.int_bits, mc.int_group_size


def use_fp8_linears(config: EngineConfig, mc: ModelConfig, device: str) -> bool:
    """Whether the model's projections are FP8 layers (W8A8, ``Fp8Linear``): with
    ``--quantization fp8`` (or an FP8 checkpoint's own method name), or by default for an FP8
    checkpoint scaled by tensor or output channel on a GPU with FP8 GEMMs (as vLLM does);
    elsewhere an FP8 checkpoint's weights are dequantized (a CPU's bf16 kernels are faster
    than its FP8 product)."""
    method = config.quantization
    if mc.int_weights and _INT_METHODS.get(method or "") == mc.int_weights:
        return False
    if method in ("awq", "awq_marlin"):
        raise InvalidRequestError(
            f"quantization {method!r} names an AWQ checkpoint's method, and this model's "
            "weights are not AWQ's"
        )
    if method not in (None, "fp8") and not mc.fp8_weights:
        raise InvalidRequestError(
            f"quantization {method!r} names an FP8 checkpoint's method, and this model's "
            "weights are not FP8 (--quantization fp8 quantizes them on load)"
        )
    if method is not None:
        return True
    return mc.fp8_weights and mc.fp8_block is None and fp8_gemm_supported(torch.device(device))


@dataclass
class RunnerSetup:
    runner: ModelRunner
    num_blocks: int  # of the KV cache
    model_dir: Path
    model_config: ModelConfig  # the whole model's (the runner holds its shard's)
    max_model_len: int
    dtype: torch.dtype
    num_host_blocks: int = 0  # of the host KV tier (--kv-offloading-size)


def build_runner(config: EngineConfig, tp_rank: int = 0) -> RunnerSetup:
    """Load the model (rank ``tp_rank``'s shard), size and allocate its KV cache, and prepare its
    kernels and CUDA graphs. Every rank of a tensor-parallel engine runs this, in step: the
    profiling pass, the graph captures and the KV sizing include collectives."""
    start = time.perf_counter()
    model_dir = resolve_model(config.model)
    mc = ModelConfig.from_path(model_dir, config.hf_overrides_dict())
    config.check_model_task(mc)
    max_model_len = _max_model_len(config, mc)
    if config.disable_sliding_window:  # (full attention, up to the window: _max_model_len)
        mc = dataclasses.replace(mc, sliding_window=None)
    dtype = resolve_dtype(config, mc)
    scaling = mc.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":  # (one set of factors an engine: rotary.py)
        original = int(scaling["original_max_position_embeddings"])
        logger.info(
            "LongRoPE: the %s factors (max_model_len %d, the original context %d)",
            "long" if max_model_len > original else "short", max_model_len, original,
        )  # fmt: skip
    kv_dtype = resolve_kv_cache_dtype(config, dtype)
    torch.manual_seed(config.seed)
    tp_size = config.tensor_parallel_size
    device = distributed.device_for(config.device, tp_rank, tp_size)
    fp8_linears = use_fp8_linears(config, mc, device)
    if fp8_linears:
        logger.info(
            "FP8 layers (W8A8): the projections' weights %s, a scale an output channel; "
            "activations quantized per token",
            "as the checkpoint's" if mc.fp8_weights and mc.fp8_block is None
            else "quantized on load",
        )  # fmt: skip
    elif mc.fp8_weights:
        logger.info("FP8 checkpoint: its weights are dequantized to %s on load", dtype)
    int_layout = int_linear_layout(mc, device)
    free_at_start = None
    if device.startswith("cuda"):  # before the model: what other processes leave us
        free_at_start = _check_gpu_share(config, torch.device(device))
    try:
        runner = ModelRunner(
            mc,
            dtype=dtype,
            device=device,
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(),
            attention_backend=config.attention_backend,
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_scheduler_steps=config.num_scheduler_steps,
            lora=lora_limits(config),
            kv_cache_dtype=kv_dtype,
            fp8_linears=fp8_linears,
            int_linears=int_layout,
            logprobs_mode=config.logprobs_mode,
        )
    except ValueError as e:  # a model that does not split tensor_parallel_size ways
        raise InvalidRequestError(str(e)) from e
    if runner.model.int_linears and int_layout is not None:
        bits, group = int_layout
        groups = f" and group of {group} columns" if group else ""
        logger.info("Integer weights (%s): kept packed, %d bits, a scale a row%s",
                    mc.int_weights, bits, groups)  # fmt: skip
    elif mc.int_weights:
        logger.info("Integer weights (%s): dequantized to %s on load", mc.int_weights, dtype)
    _load_weights(runner, config, model_dir, mc, fp8_linears)
    runner.reload_weights = functools.partial(
        _load_weights, runner, config, model_dir, mc, fp8_linears
    )
    runner.finalize_weights()
    spec = config.speculative()
    if spec is not None and spec.model is not None:
        _attach_draft(runner, config, spec, mc, max_model_len, kv_dtype)
    calculated = config.calculate_kv_scales and kv_dtype in FP8_KV_DTYPES
    if calculated:
        scales = runner.calculate_kv_scales()
        spans = (*_span([k for k, _ in scales]), *_span([v for _, v in scales]))
        logger.info("KV cache scales calculated at start-up (--calculate-kv-scales): K %.3g-%.3g, "
                    "V %.3g-%.3g", *spans)  # fmt: skip
    elif config.calculate_kv_scales:
        logger.info("--calculate-kv-scales changes nothing: the KV cache is %s", kv_dtype)
    calibrated = any(scales != (1.0, 1.0) for scales in runner.model.kv_scales())
    if kv_dtype != dtype:
        logger.info("KV cache: %s, K and V divided by %s", kv_dtype,
                    "scales calculated at start-up" if calculated
                    else "the checkpoint's scales" if calibrated else "1 (unit scale)")  # fmt: skip
    elif calibrated:
        logger.info("the checkpoint's KV cache scales serve an 8-bit cache (--kv-cache-dtype fp8)")
    if config.logits_processors:
        runner.set_logits_processors(_logits_processors(config, mc, runner, max_model_len))
    if config.runner != "generate":
        runner.pooler = PoolerConfig.resolve(config.pooler_config, model_dir, len(mc.labels))
    eager = config.enforce_eager
    if runner.device.type == "cuda" and not eager and not runner.enable_piece_graphs(capture=True):
        logger.info("prompt steps run eagerly: the experts they run depend on the routing")
    if runner.device.type == "cuda" and not eager and runner.draft is not None:
        runner.draft.runner.enable_piece_graphs(capture=True)
    num_blocks = _num_kv_blocks(config, runner, max_model_len, free_at_start)
    runner.initialize_kv_cache(num_blocks)
    num_host_blocks = _num_host_blocks(config, runner)
    if num_host_blocks:
        runner.initialize_host_kv_cache(num_host_blocks)
    if runner.device.type == "cuda":
        runner.warmup_kernels()
        drafts = spec.num_speculative_tokens if spec is not None else 0
        if runner.draft is not None:  # (its passes from CUDA graphs too: a row a token)
            runner.draft.runner.warmup_kernels()
            runner.draft.runner.enable_decode_graphs(not eager, num_speculative_tokens=drafts)
        graphs = runner.enable_decode_graphs(capture=not eager, num_speculative_tokens=drafts)
        if not graphs and not eager:
            logger.info("no CUDA graphs: the %s backend cannot be captured", runner.backend.name)
    logger.info(
        "KV cache: %d blocks, %d tokens (%s, %.1f s to load%s)",
        num_blocks,
        num_blocks * config.block_size,
        dtype if kv_dtype == dtype else f"{dtype}, the cache {kv_dtype}",
        time.perf_counter() - start,
        f"; each of {tp_size} ranks holds 1/{tp_size} of the heads" if tp_size > 1 else "",
    )
    if num_host_blocks:
        logger.info(
            "KV offloading: a host tier of %d blocks, %d tokens (%.1f GiB%s)",
            num_host_blocks,
            num_host_blocks * config.block_size,
            num_host_blocks * runner.kv_bytes_per_block() * tp_size / 2**30,
            ", page-locked" if runner.device.type == "cuda" else "",
        )
    return RunnerSetup(runner, num_blocks, model_dir, mc, max_model_len, dtype, num_host_blocks)


def _load_weights(
    runner: ModelRunner, config: EngineConfig, model_dir: Path, mc: ModelConfig, fp8: bool
) -> None:
    """The checkpoint's weights into ``runner`` (random ones with ``load_format`` "dummy")."""
    if config.load_format == "dummy":
        runner.load_dummy_weights(config.seed)
        return
    try:
        weights = iter_weights(model_dir)
        if mc.fp8_weights:
            keep = _fp8_layer if fp8 else None
            weights = dequantized_fp8(weights, mc.fp8_block, keep)
        elif mc.int_weights:
            keep = _fp8_layer if runner.model.int_linears else None
            awq = mc.int_weights == "awq"
            weights = dequantized_int(weights, mc.int_group_size, awq, keep)
        runner.load_weights(weights)
    except ValueError as e:
        raise ModelLoadError(f"cannot load weights from {model_dir}: {e}") from e


def _attach_draft(
    runner: ModelRunner,
    config: EngineConfig,
    spec: SpeculativeConfig,
    mc: ModelConfig,
    max_model_len: int,
    kv_dtype: torch.dtype,
) -> None:
    """Load the draft model of ``spec`` beside the target (``runner.draft``): its own runner
    on the same device, in the same dtypes, its KV in blocks of the same ids."""
    assert spec.model is not None
    if config.runner == "pooling":  # (a classifier's, found in its config)
        raise InvalidRequestError("a draft model (speculative_config) serves generation only")
    draft_dir = resolve_model(spec.model)
    dmc = ModelConfig.from_path(draft_dir)
    if dmc.vocab_size > mc.vocab_size:
        raise InvalidRequestError(
            f"the draft model's vocabulary ({dmc.vocab_size} tokens) is larger than the "
            f"model's ({mc.vocab_size}): a draft must use the model's tokenizer"
        )
    if dmc.max_position_embeddings < max_model_len:
        raise InvalidRequestError(
            f"the draft model's max_position_embeddings ({dmc.max_position_embeddings}) is "
            f"below max_model_len ({max_model_len})"
        )
    if dmc.is_moe:
        raise InvalidRequestError("a draft model must be dense (no mixture of experts)")
    try:
        draft = ModelRunner(
            dmc,
            dtype=runner.dtype,
            device=str(runner.device),
            block_size=runner.block_size,
            max_model_len=max_model_len,
            max_num_seqs=runner.max_num_seqs,
            # (a step's tokens and the token each request sampled: the draft's first pass)
            max_num_batched_tokens=runner.max_num_batched_tokens + runner.max_num_seqs,
            attention_backend=config.attention_backend,
            tp_rank=runner.tp_rank,  # (split as the model: each rank its heads of the draft)
            tp_size=runner.tp_size,
            kv_cache_dtype=kv_dtype,
        )
    except ValueError as e:  # a draft that does not split tensor_parallel_size ways
        raise InvalidRequestError(f"the draft model: {e}") from e
    _load_weights(draft, config, draft_dir, dmc, fp8=False)
    draft.reload_weights = functools.partial(_load_weights, draft, config, draft_dir, dmc, False)
    draft.finalize_weights()
    runner.attach_draft(draft, spec.num_speculative_tokens, spec.disable_by_batch_size)
    logger.info(
        "speculative decoding: up to %d drafts a step from the draft model %s (%d layers)",
        spec.num_speculative_tokens,
        spec.model,
        dmc.num_layers,
    )


def _host_memory_available() -> int | None:
    """Bytes of host memory available for new allocations (Linux's MemAvailable); None where
    the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _num_host_blocks(config: EngineConfig, runner: ModelRunner) -> int:
    """Blocks of the host tier that ``kv_offloading_size`` GiB hold, summed over the ranks
    (vLLM's reading: each rank holds its heads of every block); 0 without one."""
    size = config.kv_offloading_size
    if not size:
        return 0
    per_block = runner.kv_bytes_per_block() * config.tensor_parallel_size
    num_blocks = int(size * 2**30) // per_block
    if num_blocks < 1:
        raise InvalidRequestError(
            f"kv_offloading_size {size} GiB holds no KV block ({per_block} bytes each)"
        )
    available = _host_memory_available()
    if available is not None and num_blocks * per_block > available:
        raise InvalidRequestError(
            f"kv_offloading_size {size} GiB is more than the host's available memory "
            f"({available / 2**30:.1f} GiB): lower it"
        )
    if config.tensor_parallel_size > 1:
        num_blocks = distributed.all_min(num_blocks, str(runner.device))
    return num_blocks


def _max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The longest sequence served: ``max_model_len``, else the model's positions up to 8,192;
    with ``disable_sliding_window``, at most the model's sliding window (vLLM's rule: its
    layers then attend fully, which equals the window up to its length)."""
    window = mc.sliding_window if config.disable_sliding_window else None
    if config.max_model_len is None:
        longest = min(mc.max_position_embeddings, _DEFAULT_MAX_MODEL_LEN)
        return longest if window is None else min(longest, window)
    if config.max_model_len > mc.max_position_embeddings:
        raise InvalidRequestError(
            f"max_model_len {config.max_model_len} exceeds the model's "
            f"max_position_embeddings {mc.max_position_embeddings}"
        )
    if window is not None and config.max_model_len > window:
        raise InvalidRequestError(
            f"max_model_len {config.max_model_len} exceeds the model's sliding window of "
            f"{window} tokens, the most served with --disable-sliding-window"
        )
    return config.max_model_len


def _lookahead(config: EngineConfig) -> int:
    """Room each allocation leaves after a request's tokens: a draft model's drafts' KV."""
    spec = config.speculative()
    return spec.num_speculative_tokens if spec is not None and spec.model is not None else 0


def lora_limits(config: EngineConfig) -> LoRALimits | None:
    """The runner's LoRA limits (None: LoRA is off)."""
    if not config.enable_lora:
        return None
    max_cpu = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
    if max_cpu < config.max_loras:
        raise InvalidRequestError(
            f"max_cpu_loras ({max_cpu}) must be at least max_loras ({config.max_loras})"
        )
    # the adapters served by name stay read (workers check them on their gRPC threads)
    return LoRALimits(
        config.max_loras, config.max_lora_rank, max(max_cpu, len(config.lora_modules))
    )


def _gpu_lock_keys(config: EngineConfig) -> list[str]:
    """The ``gpu_lock`` keys of the GPUs an engine's ranks start on (none on a CPU)."""
    if not config.device.startswith("cuda"):
        return []
    tp_size = config.tensor_parallel_size
    keys = []
    for rank in range(tp_size):
        d = torch.device(distributed.device_for(config.device, rank, tp_size))
        keys.append(
            gpu_lock.device_key(torch.cuda.current_device() if d.index is None else d.index)
        )
    return keys


def _check_gpu_share(config: EngineConfig, device: torch.device) -> int:
    """The device's free bytes before this engine loads anything. Refuses a
    ``gpu_memory_utilization`` share larger than that (other processes hold the rest), as
    vLLM does: each process on a GPU takes its own share of the device's total memory."""
    free, total = torch.cuda.mem_get_info(device)
    wanted = config.gpu_memory_utilization * total
    if config.num_gpu_blocks_override is None and config.kv_cache_memory is None and wanted > free:
        raise InvalidRequestError(
            f"gpu_memory_utilization {config.gpu_memory_utilization} asks for "
            f"{wanted / 2**30:.1f} GiB of {device}'s {total / 2**30:.1f} GiB, but only "
            f"{free / 2**30:.1f} GiB are free ({_held(total - free, device)}): lower it"
        )
    return int(free)


def _held(used: int, device: torch.device) -> str:
    """Who holds the ``used`` bytes of ``device``: other processes, and this one's share (an
    earlier engine of this process not yet freed, as in a notebook's second ``LLM``)."""
    mine = torch.cuda.memory_reserved(device)
    if mine < 2**30:  # (a CUDA context's own, not an engine's)
        return f"{used / 2**30:.1f} GiB are held by other processes"
    return (
        f"{mine / 2**30:.1f} GiB by this process, an earlier engine not yet freed (delete it "
        f"and run gc.collect() and torch.cuda.empty_cache()); {(used - mine) / 2**30:.1f} GiB "
        "by other processes"
    )


def kv_budget_bytes(
    total: int, utilization: float, free_at_start: int, free_now: int, peak: int
) -> int:
    """Bytes for the KV pool of an engine on a GPU of ``total`` bytes: its share
    (``utilization`` of the total) less what it took since it started (weights, buffers,
    CUDA graphs: ``free_at_start - free_now``) and its peak activations; what other processes
    hold does not count against it (so workers sharing a GPU can start in any order), but the
    pool never takes more than is free now, less that peak."""
    own = free_at_start - free_now
    budget = min(int(total * utilization) - own - peak, free_now - peak)
    return max(0, budget)


def _span(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _num_kv_blocks(
    config: EngineConfig, runner: ModelRunner, max_model_len: int, free_at_start: int | None
) -> int:
    cfg = config
    per_block = runner.kv_bytes_per_block()
    if cfg.num_gpu_blocks_override is not None:
        num_blocks = cfg.num_gpu_blocks_override
    elif cfg.kv_cache_memory is not None:
        num_blocks = cfg.kv_cache_memory // per_block
    elif free_at_start is not None:
        # Profile the largest step, then give the KV pool what this engine's share leaves
        # after what it holds now (weights, buffers) and that peak.
        peak = runner.profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(runner.device)
        budget = kv_budget_bytes(total, cfg.gpu_memory_utilization, free_at_start, free, peak)
        num_blocks = budget // per_block
        logger.info(
            "GPU memory: %.1f GiB total, %.1f GiB held by other processes at start, %.1f GiB "
            "taken since (weights, buffers), %.2f GiB peak activations, %.1f GiB for the KV "
            "cache (gpu_memory_utilization %.2f)",
            total / 2**30,
            (total - free_at_start) / 2**30,
            (free_at_start - free) / 2**30,
            peak / 2**30,
            budget / 2**30,
            cfg.gpu_memory_utilization,
        )
    else:
        num_blocks = _DEFAULT_CPU_KV_BYTES // per_block
    if cfg.tensor_parallel_size > 1:  # every rank holds the same blocks (its heads of them)
        num_blocks = distributed.all_min(int(num_blocks), str(runner.device))
    needed = -(max_model_len // -cfg.block_size)
    if num_blocks < needed:
        raise InvalidRequestError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * cfg.block_size} tokens) "
            f"but one request of max_model_len={max_model_len} needs {needed}; "
            "give it more memory (kv_cache_memory) or lower max_model_len"
        )
    return int(num_blocks)


def _logits_processors(
    config: EngineConfig, mc: ModelConfig, runner: ModelRunner, max_model_len: int
) -> logits_processor.LogitsProcessors:
    """The custom logits processors of ``config.logits_processors``, made for ``runner``."""
    classes = logits_processor.load_classes(config.logits_processors)
    view = logits_processor.ProcessorConfig(
        model_config=logits_processor.ModelView(max_model_len, mc.vocab_size, runner.dtype),
        scheduler_config=logits_processor.SchedulerView(
            config.max_num_seqs, config.resolved_max_num_batched_tokens()
        ),
        engine_config=config,
    )
    processors = logits_processor.LogitsProcessors(classes, view, runner.device)
    logger.info("custom logits processors: %s", ", ".join(c.__qualname__ for c in classes))
    return processors


# What sleep mode frees and wake_up takes back (vLLM's tags).
SLEEP_TAGS = ("weights", "kv_cache")
# What a pause (or sleep) does with the requests in flight (vLLM's modes; "abort" its default):
# end them, let them finish, or keep them where they are until it ends.
PAUSE_MODES = ("abort", "wait", "keep")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidRequestError(f"unknown mode {mode!r}: one of {', '.join(PAUSE_MODES)}")


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        # Tensor parallelism: ranks 1..N-1 start here and build their shards alongside ours.
        self._tp: distributed.TensorParallelHelpers | None = None
        self._tp_lora_version = 0  # the LoRA adapters the helper ranks hold (LoRAManager.version)
        if config.tensor_parallel_size > 1:
            tp = config.tensor_parallel_size
            if config.device.startswith("cuda") and torch.cuda.device_count() < tp:
                raise InvalidRequestError(
                    f"tensor_parallel_size {tp} needs {tp} GPUs, one per rank; "
                    f"{torch.cuda.device_count()} visible"
                )
            try:  # before any process starts: does the model split that many ways?
                mc = ModelConfig.from_path(resolve_model(config.model), config.hf_overrides_dict())
                shard_config(mc, config.tensor_parallel_size)
            except ValueError as e:
                raise InvalidRequestError(str(e)) from e
            spec = config.speculative()
            if spec is not None and spec.model is not None:  # (and its draft, split as it)
                try:
                    dmc = ModelConfig.from_path(resolve_model(spec.model))
                    shard_config(dmc, config.tensor_parallel_size)
                except ValueError as e:
                    raise InvalidRequestError(f"the draft model: {e}") from e
        try:
            # One engine at a time sizes its KV cache on a GPU (gpu_lock): every rank of this
            # one starts under the locks of all their GPUs, held until the last is ready.
            with gpu_lock.hold(_gpu_lock_keys(config)):
                if config.tensor_parallel_size > 1:
                    self._tp = distributed.TensorParallelHelpers(config)
                with self._ranks_checked():  # (its collectives wait for every rank)
                    setup = build_runner(config)
                if self._tp is not None:
                    self._tp.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.runner = setup.runner
        if self._tp is not None:
            self.runner.check_ranks = self._tp.check
        self.model_dir = setup.model_dir
        self.model_config = setup.model_config
        self.max_model_len = setup.max_model_len
        self.dtype = setup.dtype
        num_blocks = setup.num_blocks
        self.kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            enable_kv_events=config.enable_kv_events,
            num_host_blocks=setup.num_host_blocks,
            num_lookahead_tokens=_lookahead(config),
            max_model_len=self.max_model_len,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(),
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            num_scheduler_steps=config.num_scheduler_steps,
            scheduling_policy=config.scheduling_policy,
            max_loras=config.max_loras if config.enable_lora else None,
            pool_every_token=self.runner.pooler.every_token,
            speculative=config.speculative(),
        )
        # Adapters served by name (--lora-modules), read now: a bad one fails the start.
        self.lora_modules = lora_requests(config.lora_modules)
        for lora_request in self.lora_modules.values():
            self._adapter(lora_request)
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        if config.tokenizer is not None:
            self.load_tokenizer()  # (a bad --tokenizer fails the start, not a later request)
        self.structured = StructuredOutputManager(self.load_tokenizer, self.model_config.vocab_size)
        self._export: _KVExport | None = None  # see enable_kv_export
        profiler = config.profiler()  # (--profiler-config; None: off)
        self.profiler = StepProfiler(profiler, self.runner.device) if profiler.profiler else None
        self.sleep_level = 0  # sleep mode: the level asleep, 0 awake (sleep, wake_up)
        self.async_scheduling = config.resolved_async_scheduling()
        # async scheduling: the step launched last, reported by the next call to step()
        self._in_flight: tuple[SchedulerOutput, StepHandle] | None = None
        # The latest step's tokens: per forward pass, and passes (multi-step scheduling).
        self.last_step_tokens: tuple[int, int] = (0, 0)
        # A step allocates a few objects per request (outputs, token lists) that mostly live on;
        # with the default thresholds the collector's older-generation passes then walk the
        # whole heap (torch, the model, imports) every few steps, which made the bookkeeping
        # of 256 running requests ~3x slower. Collect less often (never more often than now).
        now = gc.get_threshold()[:3]
        gc.set_threshold(*(max(a, b) for a, b in zip(now, _GC_THRESHOLDS, strict=True)))
        # The start-up heap (the KV pool's blocks among it: ~600k objects on a GPU) would
        # otherwise wait in a young generation for the collector's first pass over that
        # generation, which then walked it all inside one step: a 45 ms stall in the 52nd
        # decode step of a Qwen-256 run on the H200 (benchmarks/device/step_timeline.py). A
        # full collection now moves it to the oldest, which the thresholds keep from being
        # walked again for a long time (~0.1 s, once;
        # benchmarks/bench_gc_startup.py).
        gc.collect()

    def shutdown(self) -> None:
        """Stop the tensor-parallel helper processes (none with one rank); idempotent."""
        if self._tp is not None:
            runner = getattr(self, "runner", None)  # (none when start-up failed)
            if runner is not None:
                runner.release_graphs()
            self._tp.close()
            self._tp = None

    def check_alive(self) -> None:
        """Raise if the engine cannot step any more: a tensor-parallel rank is gone."""
        if self._tp is not None:
            self._tp.check()

    def on_rank_gone(self, callback: Callable[[], None]) -> None:
        """Have ``callback`` called, on another thread, when a tensor-parallel rank exits
        (never with one rank)."""
        if self._tp is not None:
            self._tp.on_gone = callback

    def load_tokenizer(self) -> Any:
        """The model's tokenizer, or the one ``--tokenizer`` names."""
        if self.config.tokenizer is not None:
            return load_named_tokenizer(self.config.tokenizer)
        return load_tokenizer(self.model_dir)

    # --- requests ------------------------------------------------------------------------------

    def validate_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> None:
        """Raise ``InvalidRequestError`` for a request ``add_request`` would refuse (reading its
        LoRA adapter, if it names one not read yet)."""
        self.scheduler.check_priority(priority)
        if lora_request is not None:
            self._adapter(lora_request)
        n = len(prompt_token_ids)
        if prompt_embeds is not None:
            n = self._check_prompt_embeds(prompt_token_ids, prompt_embeds, params)
        if n == 0:
            raise InvalidRequestError("the prompt is empty")
        runner = self.config.runner
        if isinstance(params, PoolingParams):
            if runner == "generate":
                raise InvalidRequestError(
                    "this engine runs with runner='generate': it does not embed (use "
                    "--runner pooling or auto)"
                )
            self._validate_pooling(params)
            self._validate_embedding(prompt_token_ids, params)
            return
        if self.model_config.is_classifier:
            raise InvalidRequestError(
                "this is a sequence-classification model: it classifies (and scores pairs), it "
                "does not generate"
            )
        if runner == "pooling":
            raise InvalidRequestError(
                "this engine runs with runner='pooling': it embeds, it does not generate (use "
                "--runner generate or auto)"
            )
        params.validate()
        if self.runner.logits_processors is not None:
            logits_processor.validate_params(self.runner.logits_processors.classes, params)
        cap = self.config.max_logprobs
        for kind, num in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if num is not None and 0 <= cap < num:
                raise InvalidRequestError(  # (vLLM's words)
                    f"Requested {kind} logprobs of {num}, which is greater than max allowed: "
                    f"{cap} (--max-logprobs)"
                )
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        for what, ids in (
            ("token id", prompt_token_ids if prompt_embeds is None else ()),
            ("logit_bias token id", params.logit_bias or ()),
            ("allowed_token_ids token id", params.allowed_token_ids or ()),
            ("bad_words token id", [t for seq in params.bad_words_token_ids or () for t in seq]),
        ):
            self._check_token_ids(what, ids)
        if params.bad_words and params.bad_words_token_ids is None:
            raise InvalidRequestError(
                "bad_words must come tokenized (bad_words_token_ids): the engine core has no "
                "tokenizer"
            )
        self._grammar(params)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> LoRARequest:
        """Serve the adapter at ``lora_path`` under ``lora_name`` from now on (vLLM's
        ``/v1/load_lora_adapter``); ``InvalidRequestError`` if the name is taken or the adapter
        cannot be used. On the thread that steps."""
        lora = self.runner.lora
        if lora_name in self.lora_modules:
            raise InvalidRequestError(f"The lora adapter '{lora_name}' has already been loaded.")
        if lora is not None:
            held = lora.adapters.get(lora_name)  # unloaded, but still read: its requests run
            if held is not None and Path(held.path) != Path(lora_path):
                if self.scheduler.lora_refs.get(lora_name):
                    raise InvalidRequestError(
                        f"The lora adapter '{lora_name}' was unloaded but requests still run "
                        "with it: wait for them before loading another under its name"
                    )
                lora.remove(lora_name)
        next_id = max((r.lora_int_id for r in self.lora_modules.values()), default=0) + 1
        request = LoRARequest(lora_name, next_id, lora_path)
        if lora is not None:  # the adapters served by name all stay read
            lora.max_cpu_loras = max(lora.max_cpu_loras, len(self.lora_modules) + 1)
        self._adapter(request)
        self.lora_modules[lora_name] = request
        return request

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name`` (vLLM's ``/v1/unload_lora_adapter``): new requests cannot
        name it; those running with it finish (its weights are dropped now if none runs, else
        when the host's adapter cache next needs room).
        ``NotFoundError`` if it is not served. On the thread that steps."""
        if self.lora_modules.pop(lora_name, None) is None:
            raise NotFoundError(f"The lora adapter '{lora_name}' cannot be found.")
        lora = self.runner.lora
        if lora is not None and not self.scheduler.lora_refs.get(lora_name):
            lora.remove(lora_name)

    def lora_request(self, lora_name: str | None) -> LoRARequest | None:
        """The adapter served under ``lora_name`` (``lora_modules``); None for None or ""."""
        if not lora_name:
            return None
        known = self.lora_modules.get(lora_name)
        if known is None:
            served = ", ".join(self.lora_modules) or "none"
            raise InvalidRequestError(
                f"unknown LoRA adapter {lora_name!r} (this engine serves: {served})"
            )
        return known

    def _adapter(self, lora_request: LoRARequest) -> None:
        """Have the runner hold ``lora_request``'s adapter (``InvalidRequestError`` if it
        cannot)."""
        lora = self.runner.lora
        if lora is None:
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                "(start the engine with enable_lora, --enable-lora)"
            )
        lora.add(lora_request, self.scheduler.lora_refs)

    def _check_token_ids(self, what: str, ids: Iterable[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"{what} {bad} is out of range [0, {vocab})")

    def _validate_pooling(self, params: PoolingParams) -> None:
        """A classifier's requests set no embedding options, an embedder's no activation."""
        if self.model_config.is_classifier:
            given = [k for k in ("dimensions", "normalize") if getattr(params, k) is not None]
            if given:
                raise InvalidRequestError(
                    f"{' and '.join(given)} do not apply to a sequence-classification model "
                    "(its outputs are its labels' probabilities)"
                )
        elif params.activation is not None:
            raise InvalidRequestError(
                "activation applies to sequence-classification models only (this model embeds)"
            )

    def embeds_prompt(self, prompt_embeds: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """A prompt given as input embeddings as the engine keeps it ([length, hidden size],
        the model's dtype, on the host) and its rows' ids (``prompt_embeds.row_ids``: what its
        blocks are hashed from). Raises InvalidRequestError."""
        checked = self._checked_embeds(prompt_embeds)
        return checked, embeds.row_ids(checked)

    def _checked_embeds(self, prompt_embeds: torch.Tensor) -> torch.Tensor:
        if not self.config.enable_prompt_embeds:
            raise InvalidRequestError(
                "prompt_embeds are off: start the engine with --enable-prompt-embeds "
                "(enable_prompt_embeds=True)"
            )
        return embeds.checked(prompt_embeds, self.model_config.hidden_size, self.dtype)

    def _check_prompt_embeds(
        self,
        prompt_token_ids: Sequence[int],
        prompt_embeds: torch.Tensor,
        params: SamplingParams | PoolingParams,
    ) -> int:
        """The length of a prompt given as embeddings (``prompt_token_ids``: none, or their
        rows' ids), or InvalidRequestError."""
        if isinstance(params, PoolingParams):
            raise InvalidRequestError("prompt_embeds are for generation, not embeddings")
        if params.prompt_logprobs is not None:  # (vLLM's words)
            raise InvalidRequestError("prompt_logprobs is not compatible with prompt embeds")
        checked = self._checked_embeds(prompt_embeds)
        if prompt_token_ids and len(prompt_token_ids) != len(checked):
            raise InvalidRequestError("a prompt is either token ids or prompt_embeds")
        return len(checked)

    def _validate_embedding(self, prompt_token_ids: Sequence[int], params: PoolingParams) -> None:
        n = len(prompt_token_ids)
        if n > self.max_model_len:  # (nothing is generated: the whole context is the prompt's)
            raise InvalidRequestError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}"
            )
        self._check_token_ids("token id", prompt_token_ids)
        dims = params.dimensions
        allowed = self.model_config.matryoshka_dimensions
        if dims is None:
            return
        if allowed is None:
            raise InvalidRequestError(
                "this model does not support Matryoshka representation: its embeddings cannot "
                "be cut to fewer dimensions"
            )
        if dims > self.model_config.hidden_size or (allowed and dims not in allowed):
            sizes = list(allowed) if allowed else f"1..{self.model_config.hidden_size}"
            raise InvalidRequestError(f"dimensions must be one of {sizes}, got {dims}")

    def _grammar(self, params: SamplingParams) -> Grammar | None:
        """A fresh matcher of the request's structured output, or None (raises
        ``InvalidRequestError`` for one that does not compile)."""
        so = params.structured_outputs
        return None if so is None else self.structured.grammar(so)

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        prefill_only: bool = False,
        remote_kv: object | None = None,
        first_token_id: int | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
        prompt_embeds: torch.Tensor | None = None,
    ) -> None:
        """Queue a request, with the LoRA adapter ``lora_request`` if given. ``priority`` ranks
        it under ``scheduling_policy="priority"`` (lower is served first); any other value than
        0 is refused under ``fcfs``. ``cache_salt`` (vLLM's): the request shares prefix-cache
        blocks only with requests of the same salt. ``prompt_embeds`` (``enable_prompt_embeds``):
        the prompt as input embeddings ([length, hidden size]), with no ``prompt_token_ids`` or
        the rows' ids ``embeds_prompt`` gave (a worker hashes them before it queues).

        An embedding request (``PoolingParams``) ends once its prompt is computed: its one
        output has ``pooled`` set (and a token, sampled greedily, that is no output).

        Disaggregation: ``prefill_only`` ends the request after its first token with the
        prompt's blocks held (output ``finish_reason="prefilled"``, ``kv_block_ids`` set) until
        ``release_held``. ``remote_kv`` (with the ``first_token_id`` the prefill worker sampled)
        makes the request wait for its prompt KV to be pulled (``take_kv_loads`` /
        ``finish_kv_load``) and then generate from its second token on.
        """
        self.check_awake()
        self.validate_request(prompt_token_ids, params, priority, lora_request, prompt_embeds)
        if prompt_embeds is not None and not prompt_token_ids:
            prompt_embeds, prompt_token_ids = self.embeds_prompt(prompt_embeds)
        elif prompt_embeds is not None:  # (their rows' ids, from embeds_prompt)
            prompt_embeds = self._checked_embeds(prompt_embeds)
        if req_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use")
        if (remote_kv is None) != (first_token_id is None):
            raise InvalidRequestError("remote_kv and first_token_id come together")
        if prefill_only and remote_kv is not None:
            raise InvalidRequestError("a request is either prefill-only or loads remote KV")
        pooling = None
        if isinstance(params, PoolingParams):
            if prefill_only or remote_kv is not None:
                raise InvalidRequestError("an embedding request computes its prompt itself")
            pooling, params = params, _EMBEDDING_SAMPLING
        grammar = self._grammar(params)  # (compiled by validate_request: cached)
        output_token_ids = []
        if first_token_id is not None:
            if not 0 <= first_token_id < self.model_config.vocab_size:
                raise InvalidRequestError(f"first token id {first_token_id} is out of range")
            if grammar is not None and not grammar.accept(first_token_id):
                raise InvalidRequestError(
                    f"first token id {first_token_id} does not follow the structured output"
                )
            output_token_ids.append(first_token_id)
        self.num_prompt_tokens += len(prompt_token_ids)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if pooling is not None:
            max_tokens = 1  # (its token is never computed: room may be 0)
        self.scheduler.add_request(
            Request(
                req_id=req_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_ids=self.model_config.eos_token_ids,
                max_tokens=max_tokens,
                output_token_ids=output_token_ids,
                prefill_only=prefill_only,
                remote_kv=remote_kv,
                grammar=grammar,
                priority=priority,
                pooling=pooling,
                lora_name=None if lora_request is None else lora_request.lora_name,
                cache_salt=cache_salt or None,
                prompt_embeds=prompt_embeds,
            )
        )

    def take_kv_loads(self) -> list[KVLoad]:
        """Remote-KV requests admitted since the last call: the blocks to fill for each."""
        return self.scheduler.take_kv_loads()

    def finish_kv_load(self, req_id: str, ok: bool) -> None:
        """Report a pull: on success the request decodes, otherwise it recomputes its prompt."""
        self.scheduler.finish_kv_load(req_id, ok)

    def load_kv_blocks(self, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
        """Write KV pulled from an unsharded peer (``blocks``: ``[n, layers, 2, block_size,
        all KV heads, head_dim]``) into blocks ``block_ids`` of every rank's pool, each rank
        taking its heads. Between steps, on the thread that steps; ``blocks`` may be reused
        once this returns."""
        blocks = blocks.to(self.runner.device)
        with self._ranks_checked():
            if self._tp is not None:
                self._tp.send_kv_blocks(list(block_ids), blocks)
                distributed.broadcast(blocks)
            self.runner.load_kv_blocks(block_ids, blocks)
            self.runner.synchronize()

    @property
    def whole_block_shape(self) -> tuple[int, ...]:
        """One block of the unsharded model, as KV moves between engines: ``[layers, 2,
        block_size, all KV heads, head_dim]`` (the pool holds rank 0's heads only when the
        engine is split across ranks)."""
        layers, kv, block_size, heads, head_dim = self.kv_pool.shape[1:]
        return (layers, kv, block_size, heads * self.config.tensor_parallel_size, head_dim)

    def enable_kv_export(self, num_blocks: int) -> torch.Tensor:
        """The prefill side of disaggregation: the tensor peers read a prefilled prompt's KV
        from, as whole blocks (``whole_block_shape``) at its ``prefilled`` output's
        ``kv_block_ids``, until ``release_held``.

        With one rank that is the pool itself (the prompt's blocks are held). Split across
        ranks, the pool holds rank 0's heads only: each prefilled prompt's blocks are then
        gathered from the ranks into an export area of ``num_blocks`` whole blocks (allocated
        here, once), and the pool's blocks are released (they stay in the prefix cache). A
        prompt whose blocks do not fit the area's free rows waits, its output with it, until
        ``release_held`` frees some."""
        if self._tp is None:
            return self.kv_pool
        if self._export is None:
            needed = -(self.max_model_len // -self.config.block_size)
            if num_blocks < needed:
                raise InvalidRequestError(
                    f"the KV export area of {num_blocks} blocks cannot hold one prompt of "
                    f"max_model_len={self.max_model_len} ({needed} blocks)"
                )
            pool = torch.empty(
                (num_blocks, *self.whole_block_shape),
                dtype=self.runner.kv_dtype,
                device=self.runner.device,
            )
            self._export = _KVExport(pool)
        return self._export.pool

    def _export_prefilled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Gather the prefilled prompts' blocks into the export area while it has room (one
        collective for all of them); their outputs then name its rows. The others wait, in
        order."""
        export = self._export
        assert export is not None and self._tp is not None
        export.pending += [o for o in outputs if o.finish_reason == "prefilled"]
        if not export.pending:
            return outputs
        outputs = [o for o in outputs if o.finish_reason != "prefilled"]
        block_ids: list[int] = []
        rows: list[int] = []
        while export.has_room_for_next():
            out = export.pending.pop(0)
            ids = out.kv_block_ids or []
            mine, export.free = export.free[: len(ids)], export.free[len(ids) :]
            block_ids += ids
            rows += mine
            self.scheduler.release_held(out.req_id)  # not reused before the gather below
            export.held[out.req_id] = mine
            outputs.append(out._replace(kv_block_ids=mine))
        if block_ids:
            with self._ranks_checked():
                self._tp.send_gather_kv(block_ids)
                parts = distributed.gather(self.runner.read_kv_blocks(block_ids))
                assert parts is not None
                index = torch.tensor(rows, dtype=torch.long, device=export.pool.device)
                copy_blocks_(export.pool, index, torch.cat(parts, dim=4))
                self.runner.synchronize()  # peers read the rows once we answer
        return outputs

    def release_held(self, req_id: str) -> bool:
        """Free a prefilled request's held prompt blocks (or export rows); False if none were
        held."""
        export = self._export
        if export is not None:
            rows = export.held.pop(req_id, None)
            if rows is not None:
                export.free += rows
                return True
            export.pending = [o for o in export.pending if o.req_id != req_id]
        return self.scheduler.release_held(req_id)

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Blocks stored in / removed from the prefix cache since the last call (when
        ``enable_kv_events``)."""
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash; False (nothing changed) while requests hold blocks
        (those held by a pause hold none). With KV events the kvstore hears of each block
        removed."""
        if self._num_busy():
            return False
        return self.kv.reset_prefix_cache()

    # --- pausing (vLLM's pause_generation) -----------------------------------------------------

    def pause(self, keep: bool = False) -> None:
        """Hold the requests added from now on until ``resume`` (they are accepted, not
        scheduled); the requests in flight go on (the caller aborts them, or waits for
        ``drained``), or, with ``keep`` (vLLM's mode "keep"), stop where they are and go on
        after ``resume``. A step in flight still reports."""
        self.scheduler.pause(freeze=keep)

    def resume(self) -> None:
        """Schedule again: the held requests join the queue, the kept ones go on."""
        self.scheduler.resume()

    def is_paused(self) -> bool:
        return self.scheduler.paused

    def drained(self) -> bool:
        """Whether no request but the held ones is left (after ``pause``: those in flight
        before it finished or were aborted)."""
        return not self._num_busy()

    def _num_busy(self) -> int:
        """Unfinished requests but those a pause holds, counting a step in flight and the
        prefilled prompts waiting for room in the export area as one each."""
        return (
            self.scheduler.num_active
            + (self._in_flight is not None)
            + len(self._export.pending if self._export else ())
        )

    # --- sleep mode (vLLM's) -------------------------------------------------------------------

    def sleep(self, level: int = 1, keep: bool = False) -> None:
        """Free the device's memory while idle (``enable_sleep_mode``): the KV cache's contents
        (every cached prefix, the host tier's too) and the CUDA graphs are dropped; the weights
        are copied to host memory (level 1) or dropped (level 2, read again from the model's
        files on waking). Requests are refused (``EngineSleepingError``) until ``wake_up``
        wakes both parts. Only an idle engine sleeps (``check_sleep``); asleep, it does
        nothing more. ``keep`` (vLLM's mode "keep"): the engine, paused with ``keep``, sleeps
        with its requests, whose blocks are freed: after ``wake_up`` they compute their
        tokens again and go on. Level 0 only pauses (``pause``) until ``wake_up``."""
        if not self.check_sleep(level, keep=keep):
            return
        if level == 0:
            self.pause(keep)
            return
        if keep:
            self.scheduler.preempt_all()
        reset = self.kv.reset_prefix_cache()
        assert reset, "an idle engine's blocks are all free"
        start = time.perf_counter()
        with self._ranks_checked():
            if self._tp is not None:
                self._tp.sleep(level)
            self.runner.sleep(level)
        self.sleep_level = level
        logger.info("asleep (level %d) in %.2f s", level, time.perf_counter() - start)

    def check_sleep(self, level: int, busy_ok: bool = False, keep: bool = False) -> bool:
        """Raise ``InvalidRequestError`` if ``sleep(level, keep)`` would be refused
        (``EngineBusyError`` while requests run or hold blocks, unless ``busy_ok``; with
        ``keep``, while the engine is not paused with keep or a step, a pull or a prefilled
        prompt's blocks are in flight); returns whether it would change anything (not when
        asleep already)."""
        if not self.config.enable_sleep_mode:
            raise InvalidRequestError(
                "sleep mode is off: start the engine with enable_sleep_mode=True "
                "(--enable-sleep-mode)"
            )
        if level not in (0, 1, 2):
            raise InvalidRequestError(f"the sleep level must be 0, 1 or 2, not {level!r}")
        if self.runner.asleep:
            return False
        if level == 0:
            return True
        if level == 2 and self.runner.lora is not None:
            raise InvalidRequestError(
                "sleep level 2 with LoRA enabled: the adapters' slots live beside the weights "
                "it drops; level 1 keeps them"
            )
        if busy_ok:
            return True
        if not keep:
            self._check_idle("sleeps")
        elif not self.scheduler.frozen:
            raise InvalidRequestError("sleep with keep: pause the engine with keep first")
        elif self._in_flight is not None or self.scheduler.loading or self._export_busy():
            raise EngineBusyError("a step, a pull or a prefilled prompt's blocks are in flight")
        return True

    def _export_busy(self) -> bool:
        """Whether prefilled prompts hold blocks (or export rows) for their pulls."""
        export = self._export
        return bool(self.kv.num_held_requests or (export and (export.pending or export.held)))

    def _check_idle(self, what: str, kept_ok: bool = False) -> None:
        """Raise ``EngineBusyError`` while requests run or hold KV blocks (requests a pause
        holds hold none). ``kept_ok``: requests a pause with keep stopped are no bar once
        they hold no blocks (sleep with keep freed them)."""
        num_busy = self._num_busy()
        kept = kept_ok and self.scheduler.frozen and self._in_flight is None
        if num_busy and not (kept and not self.scheduler.loading):
            raise EngineBusyError(
                f"{num_busy} requests are unfinished: only an idle engine {what} (finish or "
                "abort them first)"
            )
        pool = self.kv.pool
        if pool.num_free_blocks != pool.num_blocks:
            raise EngineBusyError(
                f"{pool.num_blocks - pool.num_free_blocks} KV blocks are held (by requests "
                f"kept by a pause, or prefilled prompts waiting for their pull): only an idle "
                f"engine {what}"
            )

    def reload_weights(self) -> None:
        """Read the weights again from the model's files, in place (vLLM's
        ``collective_rpc("reload_weights")``: after ``wake_up(["weights"])`` at level 2, or to
        undo weights changed in memory); the prefix cache is forgotten (its KV came from the
        weights before). Every rank reads its shard; a draft model reads its own."""
        if "weights" in self.runner.asleep:
            raise InvalidRequestError("the weights are asleep: wake_up(['weights']) first")
        if self.runner.packed_weights:
            raise InvalidRequestError(
                "the weights are packed for the CPU's kernels, which the checkpoint does not "
                "load into in place (serve float32, or start a new engine)"
            )
        self._check_idle("reads its weights again", kept_ok=True)
        start = time.perf_counter()
        with self._ranks_checked():
            if self._tp is not None:
                self._tp.reload_weights()
            self.runner.read_weights_again()
        if "kv_cache" not in self.runner.asleep:
            reset = self.kv.reset_prefix_cache()
            assert reset, "an idle engine's blocks are all free"
        logger.info("read the weights again in %.2f s", time.perf_counter() - start)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take back the memory of ``tags`` (vLLM's: "weights", "kv_cache"; default both):
        weights first lets a caller load others before the KV cache takes its room. Serves
        again once both are awake (the CUDA graphs captured again)."""
        wake = list(tags) if tags is not None else list(SLEEP_TAGS)
        unknown = sorted(set(wake) - set(SLEEP_TAGS))
        if unknown:
            raise InvalidRequestError(
                f"unknown wake_up tags {unknown}: valid ones are {list(SLEEP_TAGS)}"
            )
        waking = self.runner.asleep & set(wake)
        if not waking:
            if not self.runner.asleep:
                self.resume()  # (vLLM's wake_up resumes a paused engine: sleep level 0)
            return
        start = time.perf_counter()
        with self._ranks_checked():
            if self._tp is not None:
                self._tp.wake_up(wake)
            self.runner.wake_up(wake)
        if not self.runner.asleep:
            self.sleep_level = 0
            self.resume()
        logger.info(
            "woke %s in %.2f s%s",
            " and ".join(t for t in SLEEP_TAGS if t in waking),
            time.perf_counter() - start,
            f"; still asleep: {sorted(self.runner.asleep)}" if self.runner.asleep else "",
        )

    def is_sleeping(self) -> bool:
        """Whether any part is asleep (requests are refused)."""
        return bool(self.runner.asleep)

    def check_awake(self) -> None:
        """Raise ``EngineSleepingError`` while any part is asleep."""
        if self.runner.asleep:
            raise EngineSleepingError(
                f"the engine is asleep (sleep level {self.sleep_level}): wake it up first "
                "(wake_up, POST /wake_up)"
            )

    def cache_config_info(self) -> dict[str, object]:
        """The KV cache's settings, under vLLM's names (its ``cache_config_info`` labels;
        ``num_gpu_blocks`` counts the KV blocks wherever they live, as vLLM's CPU backend
        does)."""
        config = self.config
        return {
            "block_size": config.block_size,
            "num_gpu_blocks": self.kv.pool.num_blocks,
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": config.enable_prefix_caching,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "kv_cache_size_tokens": self.kv.pool.num_blocks * config.block_size,
            # the host tier's blocks (--kv-offloading-size; vLLM's name for blocks in host memory)
            "num_cpu_blocks": self.kv.host.num_slots if self.kv.host is not None else 0,
        }

    @property
    def first_scheduled(self) -> list[tuple[str, float]]:
        """Requests the latest step scheduled for the first time, with when
        (``time.monotonic()``): their queue time ends there."""
        return self.scheduler.first_scheduled

    def lora_adapters(self) -> tuple[list[str], list[str]]:
        """The adapters of the running requests (those loading remote KV too), and of the
        waiting ones, each sorted by name (vLLM's ``lora_requests_info``)."""
        scheduler = self.scheduler
        if not scheduler.lora_refs:
            return [], []
        running = scheduler.running_loras()
        waiting = {r.lora_name for r in scheduler.waiting if r.lora_name is not None}
        return sorted(running), sorted(waiting)

    def cached_block_hashes(self) -> list[bytes]:
        """Every hash the prefix cache holds now, in the pool or the host tier (to resync the
        kvstore's index)."""
        return self.kv.cached_hashes()

    @property
    def kv_pool(self) -> torch.Tensor:
        """The one KV allocation, ``[num_blocks, ...]``: one block is one contiguous range."""
        pool = self.runner.kv_pool
        assert pool is not None
        return pool

    def abort_requests(
        self, req_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> None:
        self.scheduler.finish_requests(req_ids, status)

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self._in_flight is not None
            or bool(self._export and self._export.pending)
        )

    def has_schedulable_requests(self) -> bool:
        """Whether ``step`` would run or report anything (requests waiting for remote KV do
        not count, nor prefilled ones waiting for room in the export area)."""
        return (
            self.scheduler.has_schedulable_requests()
            or self._in_flight is not None
            or bool(self._export and self._export.has_room_for_next())
        )

    # --- the loop ------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run, update: one forward pass over the batch.

        With async scheduling the step is launched and the previous one's outputs are
        returned: the host schedules and prepares step N+1 while the device runs step N, and
        waits only for step N's sampled tokens. A step whose requests need their previous
        tokens on the host (penalties, logprobs, structured output) waits for them before it
        is launched."""
        profiler = self.profiler
        if profiler is None or not profiler.running:
            return self._step()
        with profiler.step("engine_step"):
            return self._step()

    # --- profiling (vLLM's start_profile / stop_profile) ---------------------------------------

    def start_profile(self, prefix: str | None = None) -> None:
        """Record the steps from now on, on every rank (``--profiler-config``; ``prefix``
        starts the traces' names)."""
        self._check_profiler().start(prefix)  # (first: the helpers follow rank 0's state)
        if self._tp is not None:
            with self._ranks_checked():
                self._tp.profile(True, prefix)

    def stop_profile(self) -> None:
        """Stop recording and write each rank's trace (seconds for long recordings)."""
        self._check_profiler().stop()
        if self._tp is not None:
            with self._ranks_checked():
                self._tp.profile(False)
                distributed.all_reduce(torch.zeros(1, device=self.runner.device))  # (written)

    def _check_profiler(self) -> StepProfiler:
        if self.profiler is None:
            raise InvalidRequestError(
                "profiling is off: start the engine with a profiler_config "
                '(--profiler-config \'{"profiler": "torch", "torch_profiler_dir": DIR}\', or '
                "$VLLM_TORCH_PROFILER_DIR)"
            )
        return self.profiler

    def _step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        self.last_step_tokens = (so.total_num_scheduled_tokens, so.num_steps)
        outputs: list[EngineCoreOutput] = []
        with self._ranks_checked():
            if self._in_flight is not None and (
                not self.runner.can_run_ahead(so) or self._grammar_waits(so)
            ):
                outputs = self._finish_in_flight()
            if self._tp is not None:
                lora = self.runner.lora
                if lora is not None and lora.version != self._tp_lora_version:
                    self._tp.hold_adapters(lora.held())
                    self._tp_lora_version = lora.version
                self._tp.step(so)
            grammar = None
            if self.scheduler.num_grammars and not so.is_empty:
                grammar = functools.partial(self._grammar_bitmask, so)  # (filled in launch)
            handle = self.runner.launch(so, grammar)
            if self._in_flight is not None:
                outputs = self._finish_in_flight()
            self._in_flight = (so, handle)
            if not self.async_scheduling or so.is_empty:
                outputs += self._finish_in_flight()
        if self._export is not None:
            outputs = self._export_prefilled(outputs)
        if not self.scheduler.has_unfinished_requests() and not self.scheduler.num_loading:
            self.check_invariants(full=None)  # idle: it catches leaks early
        return outputs

    def _grammar_waits(self, so: SchedulerOutput) -> bool:
        """Whether a request of ``so`` with structured output has a token still pending (one
        resumed after a preemption: the runner's check sees only those it kept): its mask
        needs it accepted first."""
        if not self.scheduler.num_grammars:
            return False
        requests = self.scheduler.requests
        for req_id in so.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and request.grammar is not None and request.num_pending_tokens:
                return True
        return False

    def _grammar_bitmask(self, so: SchedulerOutput) -> GrammarBitmask | None:
        """The next tokens each scheduled request with structured output may sample (its
        previous tokens are all accepted: such requests never run ahead of them). The runner
        asks for it once the step's forward pass is queued: the fill overlaps the device's
        work."""
        requests = self.scheduler.requests
        grammars = {}
        for req_id in so.num_scheduled_tokens:
            request = requests.get(req_id)
            if request is not None and request.grammar is not None:
                grammars[req_id] = request.grammar
        if not grammars:
            return None
        if not so.spec_token_ids:
            bitmask = self.structured.bitmask(list(grammars.values()))
            return GrammarBitmask({r: i for i, r in enumerate(grammars)}, bitmask)
        # a request's drafts take the rows after its own, one after each draft
        drafts = [so.spec_token_ids.get(req_id, []) for req_id in grammars]
        bitmask = self.structured.bitmask(list(grammars.values()), drafts)
        firsts = accumulate((1 + len(d) for d in drafts[:-1]), initial=0)
        rows = dict(zip(grammars, firsts, strict=True))
        return GrammarBitmask(rows, bitmask)

    @contextlib.contextmanager
    def _ranks_checked(self) -> Iterator[None]:
        """Work with collectives inside: when a tensor-parallel rank is gone, a collective may
        fail (gloo) or end early with garbage (NCCL, aborted): either way, the error names
        the rank, and nothing computed with it comes out."""
        try:
            yield
        except Exception:
            if self._tp is not None:
                self._tp.check(grace_s=1.0)
            raise
        if self._tp is not None:
            self._tp.check()

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        assert self._in_flight is not None
        so, handle = self._in_flight
        self._in_flight = None
        embeddings = self.scheduler.num_embeddings  # (their outputs carry no token)
        outputs = self.scheduler.update_from_output(so, handle.result())
        if so.num_steps == 1 and not embeddings and not so.spec_token_ids:
            self.num_generated_tokens += len(outputs)  # one new token each
        else:
            self.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(),
            num_prefix_queries=self.kv.num_prefix_queries,
            num_prefix_hits=self.kv.num_prefix_hits,
            num_host_queries=self.kv.num_host_queries,
            num_host_hits=self.kv.num_host_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_spec_drafts=self.scheduler.num_spec_drafts,
            num_draft_tokens=self.scheduler.num_draft_tokens,
            num_accepted_tokens=self.scheduler.num_accepted_tokens,
            num_accepted_per_pos=tuple(self.scheduler.num_accepted_per_pos),
        )

    def check_invariants(self, full: bool | None = True) -> None:
        """Raise AssertionError if the scheduler's or the KV cache's bookkeeping is
        inconsistent. ``full=False`` checks the blocks in use only (see ``KVCacheManager``);
        ``None`` checks everything for pools of up to ``_FULL_CHECK_MAX_BLOCKS`` blocks and the
        blocks in use for larger ones: the full walk of a GPU's pool (~360k blocks of the
        default model on an H200) costs ~20-40 ms, which the idle checks after each step must
        not add to a request's latency."""
        if full is None:
            full = self.kv.pool.num_blocks <= _FULL_CHECK_MAX_BLOCKS
        if self._in_flight is None:
            self.scheduler.check_invariants(full)
        export = self._export
        if export is not None:
            rows = [r for held in export.held.values() for r in held] + export.free
            assert sorted(rows) == list(range(export.pool.shape[0])), "export rows leaked"

"""Engine flags for command lines, with vLLM's names (`--max-model-len`, `--max-num-seqs`)."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields
from typing import Any

from baton_engine.config import LOGPROBS_MODES, RUNNERS, SCHEDULING_POLICIES, EngineConfig
from baton_engine.vllm_flags import ENGINE_FLAGS, add_flags, check_flags

_HELP = {
    "tokenizer": "a local folder (or .gguf file) whose tokenizer to use instead of the model's",
    "max_model_len": "context length (prompt + output; 32k = 32,000, 32K = 32,768, as in vLLM); "
    "default: the model's, at most 8192",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step (default: 8192 offline, 16384 "
    "on GPUs of >= 70 GiB but the A100; 512 serving on CPU, 2048 on GPU)",
    "long_prefill_token_threshold": "chunk prompts longer than this (0: no limit)",
    "block_size": "tokens per KV cache block",
    "enable_prefix_caching": "reuse KV blocks across requests with equal prefixes",
    "dtype": "auto | bfloat16 | float32 | float16",
    "kv_cache_dtype": "auto (the model's dtype) | fp8 / fp8_e4m3 | fp8_e5m2 (K and V stored as "
    "8-bit floats, divided by an FP8 checkpoint's KV scales, else by 1: twice the tokens in the "
    "same memory) | bfloat16 (a bfloat16 model's, as auto)",
    "quantization": "fp8: the layers' projections run FP8 GEMMs (W8A8: weights FP8 with a "
    "scale an output channel, quantized on load unless the checkpoint's are; activations "
    "quantized per token; GPUs of compute capability >= 8.9, elsewhere torch's slower CPU "
    "product); default: the checkpoint's (an FP8 checkpoint's FP8 on such GPUs)",
    "kv_cache_memory": "bytes for the KV cache on CPU (default 2 GiB)",
    "num_gpu_blocks_override": "exact number of KV blocks",
    "kv_offloading_size": "GiB of host memory (summed over tensor-parallel ranks) for a second "
    "tier of the prefix cache: blocks the KV cache evicts are copied there and back on a later "
    "hit, instead of being computed again (vLLM's; default: none)",
    "kv_offloading_backend": "native (Baton's own host tier; vLLM's lmcache is not supported)",
    "gpu_memory_utilization": "share of the GPU's total memory this engine takes for weights, "
    "activations and KV cache (processes sharing a GPU each take their own share)",
    "load_format": "auto | dummy (random weights, for benchmarks)",
    "attention_backend": "auto | cpu (C++ paged decode kernel) | triton (GPU) | torch "
    "(reference) | flash_attn | flashinfer (when installed); also $BATON_ATTENTION_BACKEND",
    "enforce_eager": "GPU: run every step eagerly instead of replaying CUDA graphs",
    "enable_sleep_mode": "let an idle engine give its device memory back (vLLM's sleep mode: "
    "POST /sleep?level=1 copies the weights to host memory, level=2 drops them; both drop the "
    "KV cache; POST /wake_up takes it back)",
    "enable_prompt_embeds": "accept prompts given as the model's input embeddings (vLLM's "
    "prompt_embeds: a base64 torch.save tensor [prompt length, hidden size] in /v1/completions, "
    "{'prompt_embeds': tensor} offline) instead of tokens",
    "disable_sliding_window": "attend fully in the model's sliding-window layers, serving "
    "sequences up to the window's length (vLLM's)",
    "async_scheduling": "schedule the next step while the device runs this one (default: on "
    "for GPUs, off for CPUs)",
    "num_scheduler_steps": "forward passes a step runs when every running request is a plain "
    "decode (multi-step scheduling: less host work per token, tokens arrive that many at a "
    "time); 1: off",
    "scheduling_policy": "fcfs: requests in order of arrival | priority: by each request's "
    "priority (lower first), ties in order of arrival; the lowest-priority running request is "
    "preempted first",
    "runner": "auto: generation and embeddings | generate: generation only | pooling: "
    "embeddings only (vLLM's --runner; a sequence-classification model always pools)",
    "task": "vLLM's older --task: generate (as --runner generate) | embed, embedding (as "
    "--runner pooling) | classify, score (a sequence-classification model) | auto",
    "convert": "vLLM's --convert: embed (serve the model as an embedding model: --runner "
    "pooling) | classify (a sequence-classification model) | none | auto",
    "pooler_config": 'how embeddings pool, as JSON: {"pooling_type": "LAST" | "MEAN" | '
    '"CLS", "normalize": true | false} (default: the model\'s sentence-transformers config, '
    "else LAST, normalized)",
    "hf_overrides": "keys of the model's config.json to replace, as JSON (vLLM's): e.g. "
    '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
    '"original_max_position_embeddings": 32768}}\'',
    "seed": "seed of the default random generator",
    "device": "cpu | cuda",
    "tensor_parallel_size": "split the model's heads and MLP across this many processes: one "
    "GPU each (NCCL), or CPU processes (gloo)",
    "enable_lora": "serve LoRA adapters (requests name one by their model)",
    "max_loras": "most LoRA adapters one step may use (others wait)",
    "max_lora_rank": "largest LoRA rank accepted",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: max_loras)",
    "max_logprobs": "the most logprobs (and prompt logprobs) per token a request may ask for "
    "(-1: Baton's most, 20)",
    "calculate_kv_scales": "with an 8-bit KV cache (--kv-cache-dtype fp8): each layer's K and V "
    "scales from one pass of the model over random tokens at start-up, max|K| / 200 and max|V| "
    "/ 100 (vLLM's ranges), instead of the checkpoint's or 1",
    "logprobs_mode": "what sampled tokens' logprobs report: raw_logprobs (the model's own "
    "distribution) | raw_logits | processed_logprobs | processed_logits (the distribution a "
    "token is drawn from: after bad words, logit bias, penalties, and for sampled requests "
    "temperature, top-k, top-p and min-p, the tokens they cut at -inf); prompt logprobs are "
    "always the model's own",
    "logits_processors": "custom logits processors run on every step's logits: classes, each "
    "package.module.Class or package.module:Class, subclasses of "
    "baton_engine.logits_processor.LogitsProcessor (vLLM V1's interface; requests pass them "
    "arguments in vllm_xargs)",
    "speculative_config": "speculative decoding, as vLLM's JSON: n-gram lookup, "
    '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
    '"prompt_lookup_min": 2}\', or a draft model of the same vocabulary, '
    '\'{"model": PATH, "num_speculative_tokens": 4}\' (optional: "disable_by_batch_size": '
    "N); greedy requests get exactly their tokens, sampled ones their distribution",
    "profiler_config": "vLLM's profiling, as JSON: "
    '\'{"profiler": "torch", "torch_profiler_dir": DIR}\' records torch.profiler traces of '
    "the engines' steps between POST /start_profile and /stop_profile (LLM.start_profile / "
    'stop_profile offline), one Chrome trace a worker and rank in DIR; "cuda" brackets them '
    "with cudaProfilerStart/Stop for Nsight Systems; default: $VLLM_TORCH_PROFILER_DIR if set",
    "lora_modules": "LoRA adapters served by name: name=path or vLLM's JSON "
    '\'{"name": ..., "path": ..., "base_model_name": ...}\' (needs --enable-lora)',
}


# vLLM's short forms and older names
_ALIASES = {
    "tensor_parallel_size": ("-tp",),
    "quantization": ("-q",),
    "pooler_config": ("--override-pooler-config",),
}


def human_readable_int(value: str) -> int:
    """An integer as vLLM's ``--max-model-len`` reads one: plain, or with a suffix, lower case
    decimal (``32k`` = 32,000, ``25.6k``) or upper case binary (``32K`` = 32,768; whole
    numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", value.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid integer {value!r} (e.g. 4096, 32k, 32K)")
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a whole number (decimals take a decimal suffix: k, m, g, t)"
        )
    power = "KMGT".index(suffix) + 1 if suffix else 0
    return int(number) << (10 * power)


_TYPES: dict[str, Any] = {  # (None defaults: ints)
    "pooler_config": str,
    "hf_overrides": str,
    "speculative_config": str,
    "profiler_config": str,
    "tokenizer": str,
    "quantization": str,
    "max_model_len": human_readable_int,  # (vLLM's: 32k, 32K)
    "max_num_batched_tokens": human_readable_int,
    "kv_offloading_size": float,
}
_CHOICES = {
    "scheduling_policy": SCHEDULING_POLICIES,
    "runner": RUNNERS,
    "logprobs_mode": LOGPROBS_MODES,
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Baton's engine flags, and vLLM's others (``vllm_flags.ENGINE_FLAGS``)."""
    defaults = EngineConfig()
    for f in fields(EngineConfig):
        if f.name not in _HELP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool) or f.name == "async_scheduling":
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP[f.name]
            )
        elif isinstance(default, tuple):  # a list of values (--lora-modules a=x b=y)
            parser.add_argument(flag, nargs="+", default=list(default), help=_HELP[f.name])
        else:
            kind: Any = _TYPES.get(f.name, type(default) if default is not None else int)
            names = (flag, *_ALIASES.get(f.name, ()))
            parser.add_argument(
                *names,
                type=kind,
                default=default,
                choices=_CHOICES.get(f.name),
                help=_HELP[f.name],
            )

    add_flags(parser, ENGINE_FLAGS)


def engine_kwargs_from_args(args: argparse.Namespace, check: bool = True) -> dict[str, Any]:
    """The engine flags of parsed ``args`` as ``EngineConfig`` keyword arguments (no model);
    vLLM's other flags are left out, once checked (``InvalidRequestError`` for a value Baton
    cannot serve; ``check=False``: they were already)."""
    if check:
        check_flags(vars(args), ENGINE_FLAGS)
    kwargs = {name: getattr(args, name) for name in _HELP if hasattr(args, name)}
    for name in ("lora_modules", "logits_processors"):
        if name in kwargs:
            kwargs[name] = tuple(kwargs[name])
    return kwargs

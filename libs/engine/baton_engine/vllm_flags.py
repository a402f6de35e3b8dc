"""vLLM flags that Baton accepts so that a vLLM command line (or ``LLM(...)`` call) runs
unchanged, though here they change nothing, or nothing as long as they keep a value Baton
serves.

Each :class:`VllmFlag` says what Baton does instead. A flag given a value Baton cannot honour
(``--pipeline-parallel-size 2``, ``--cpu-offload-gb 4``...) is a clear
error at start-up, never silently dropped; one given a value that changes nothing here
(``--trust-remote-code``, ``--swap-space 16``...) is logged once with the reason. The flags
Baton implements keep their own definitions (``arg_utils``, the gateway's command line);
these are the rest of what vLLM's ``serve`` and ``LLM`` commonly take.

Imports no torch: the gateway's command line reads :data:`FRONTEND_FLAGS`.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from baton_engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# The workers' engine metrics are named baton:* or, with --metric-names vllm, vllm:* as vLLM
# names them (so that dashboards and autoscalers built for vLLM read them unchanged).
METRIC_PREFIXES = ("baton", "vllm")


@dataclass(frozen=True)
class VllmFlag:
    name: str  # vLLM's name (``LLM`` keyword; ``--name-with-dashes`` on a command line)
    note: str  # what Baton does instead (why the value changes nothing, or cannot be served)
    default: Any = None  # vLLM's default
    kind: Any = str  # how a command line reads the value; bool: --flag / --no-flag
    # The values Baton serves; None: any (the flag changes nothing here).
    accepts: Callable[[Any], bool] | None = None
    aliases: tuple[str, ...] = ()  # vLLM's other spellings on a command line
    nargs: str | None = None  # "+": several values, as vLLM takes them

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


_NO_DOWNLOAD = (
    "nothing is downloaded: Baton reads local folders, GGUF files and repository ids already in "
    "the Hugging Face cache ($HF_HUB_CACHE: point it at a --download-dir), at their main ref"
)
_NO_REMOTE_CODE = (
    "Baton runs its own implementation of each architecture it serves; no model code is loaded"
)
_REQUEST_LOGS = "Baton logs no request contents (trace requests with --otlp-endpoint)"
_DATA_PARALLEL = "one Baton stack runs several engines as --num-decode (and --num-prefill) workers"
_DATA_PARALLEL_SIZE = (
    "`baton serve --data-parallel-size N` runs N decode workers (--num-decode N, aggregated "
    "unless --mode says otherwise); an offline LLM(...) is one engine"
)
_PREFILLS = "the scheduler fills each step's token budget with the waiting prompts, in order"
_TEXT_ONLY = "Baton serves text-only models: prompts carry no images or audio"


def _json_backend(value: Any) -> Any:
    """The ``backend`` of a JSON object given as text (or a dict), else "?"."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return "?"
    return parsed.get("backend", "auto") if isinstance(parsed, dict) else "?"


ENGINE_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("trust_remote_code", _NO_REMOTE_CODE, False, bool),
    VllmFlag("download_dir", _NO_DOWNLOAD),
    VllmFlag("revision", _NO_DOWNLOAD),
    VllmFlag("code_revision", _NO_DOWNLOAD),
    VllmFlag("tokenizer_revision", _NO_DOWNLOAD),
    VllmFlag(
        "tokenizer_mode",
        "Baton uses the model's Hugging Face fast tokenizer ('auto'); 'mistral' and "
        "'custom' are not supported",
        "auto",
        accepts=_one_of("auto", "hf", "slow"),
    ),
    VllmFlag(
        "swap_space",
        "preempted requests are recomputed; nothing is swapped to host memory",
        4.0,
        float,
    ),
    VllmFlag(
        "enable_chunked_prefill",
        "Baton always fits long prompts into each step's token budget in chunks",
        None,
        bool,
    ),
    VllmFlag("max_num_partial_prefills", _PREFILLS, 1, int),
    VllmFlag(
        "distributed_executor_backend",
        "tensor-parallel ranks are always local processes of the engine ('mp'); Ray is not "
        "supported",
        accepts=_one_of(None, "mp", "uni"),
    ),
    VllmFlag("disable_custom_all_reduce", "ranks all-reduce with NCCL (gloo on CPUs)", False, bool),
    VllmFlag("max_parallel_loading_workers", "weights load in one pass", None, int),
    VllmFlag(
        "max_seq_len_to_capture",
        "CUDA graphs serve decode steps of any context length",
        None,
        int,
    ),
    VllmFlag(
        "cuda_graph_sizes",
        "Baton captures CUDA graphs at batch sizes it picks from --max-num-seqs "
        "(--enforce-eager turns them off)",
        kind=int,
        nargs="+",
    ),
    VllmFlag(
        "compilation_config",
        "Baton does not use torch.compile; it captures CUDA graphs itself (--enforce-eager "
        "turns them off)",
        aliases=("-O",),
    ),
    VllmFlag("disable_cascade_attn", "Baton has no cascade attention", False, bool),
    VllmFlag("prefix_caching_hash_algo", "Baton hashes prefix blocks its own way", "builtin"),
    VllmFlag("safetensors_load_strategy", "weights are read with safetensors' own loader"),
    VllmFlag(
        "model_impl",
        "Baton runs its own implementation of each architecture; 'transformers' is not supported",
        "auto",
        accepts=_one_of("auto", "vllm"),
    ),
    VllmFlag("limit_mm_per_prompt", _TEXT_ONLY),
    VllmFlag(
        "pipeline_parallel_size",
        "Baton splits a model across GPUs with --tensor-parallel-size only",
        1,
        int,
        _one_of(1),
        aliases=("-pp",),
    ),
    VllmFlag(
        "data_parallel_size",
        _DATA_PARALLEL_SIZE,
        1,
        int,
        _one_of(1),
        aliases=("-dp",),
    ),
    VllmFlag(
        "enable_expert_parallel",
        "the tensor-parallel ranks split every expert by its intermediate size instead of "
        "holding whole experts: the same outputs, another layout",
        False,
        bool,
    ),
    VllmFlag(
        "cpu_offload_gb",
        "weights stay on the device; none are offloaded",
        0.0,
        float,
        _one_of(0, 0.0),
    ),
    VllmFlag(
        "kv_transfer_config",
        "Baton disaggregates prefill and decode by itself (baton serve: --mode, "
        "--kv-transfer); vLLM's KV connectors are not used",
        accepts=_one_of(None),
    ),
    VllmFlag(
        "kv_events_config",
        "KV events go to Baton's kvstore by themselves in disaggregated mode",
        accepts=_one_of(None),
    ),
    VllmFlag("hf_token", _NO_DOWNLOAD),
    VllmFlag("ignore_patterns", "weights are read from the model folder's safetensors"),
    VllmFlag("use_tqdm_on_load", "no progress bar while weights load", True, bool),
    VllmFlag("pt_load_map_location", "weights are read to the engine's device"),
    VllmFlag("model_loader_extra_config", "weights load one way, with safetensors"),
    VllmFlag(
        "config_format", "the model's config.json is read", "auto", accepts=_one_of("auto", "hf")
    ),
    VllmFlag(
        "preemption_mode",
        "preempted requests are recomputed; nothing is swapped",
        accepts=_one_of(None, "recompute"),
    ),
    VllmFlag("use_v2_block_manager", "(a no-op in vLLM too)", False, bool),
    VllmFlag("disable_async_output_proc", "(vLLM V0's)", False, bool),
    VllmFlag("multi_step_stream_outputs", "(vLLM V0's)", True, bool),
    VllmFlag("scheduler_delay_factor", "new prompts are scheduled as soon as they fit", 0.0, float),
    VllmFlag("max_long_partial_prefills", _PREFILLS, 1, int),
    VllmFlag("tokenizer_pool_size", "the gateway tokenizes (workers need no tokenizer)", 0, int),
    VllmFlag("disable_mm_preprocessor_cache", _TEXT_ONLY, False, bool),
    VllmFlag("mm_processor_kwargs", _TEXT_ONLY),
    VllmFlag("collect_detailed_traces", "traces carry Baton's own spans (--otlp-endpoint)"),
    VllmFlag("show_hidden_metrics_for_version", "Baton's metrics are all shown"),
    VllmFlag(
        "kv_sharing_fast_prefill",
        "(for models that share KV across layers; none here)",
        False,
        bool,
    ),
    VllmFlag("mamba_ssm_cache_dtype", "Baton serves no Mamba models", "auto"),
    VllmFlag("ray_workers_use_nsight", "Baton does not use Ray", False, bool),
    VllmFlag(
        "guided_decoding_backend",
        "structured output is compiled by XGrammar",
        "auto",
        accepts=_one_of("auto", "xgrammar"),
    ),
    VllmFlag(
        "structured_outputs_config",
        "structured output is compiled by XGrammar (backend auto or xgrammar)",
        accepts=lambda v: v is None or _json_backend(v) in ("auto", "xgrammar"),
    ),
    VllmFlag(
        "structured_outputs_config.backend",
        "structured output is compiled by XGrammar",
        accepts=_one_of(None, "auto", "xgrammar"),
    ),
    VllmFlag("lora_dtype", "adapters run in the model's dtype", "auto", accepts=_one_of("auto")),
    VllmFlag("fully_sharded_loras", "adapters follow the base weights' split", False, bool),
    VllmFlag("lora_extra_vocab_size", "adapters that add tokens are not supported", 256, int),
    VllmFlag("enable_lora_bias", "LoRA bias is not supported", False, bool, _one_of(False)),
    VllmFlag(
        "long_lora_scaling_factors", "long-context LoRA is not supported", accepts=_one_of(None)
    ),
    VllmFlag("qlora_adapter_name_or_path", "QLoRA is not supported", accepts=_one_of(None)),
    VllmFlag(
        "enable_prompt_adapter", "prompt adapters are not supported", False, bool, _one_of(False)
    ),
    VllmFlag("max_prompt_adapters", "prompt adapters are not supported", 1, int),
    VllmFlag(
        "logits_processor_pattern",
        "(vLLM V0's per-request processors by name; V1's are --logits-processors)",
    ),
    VllmFlag(
        "num_lookahead_slots",
        "speculative decoding sizes its slots from --speculative-config",
        0,
        int,
        _one_of(0),
    ),
    VllmFlag(
        "rope_scaling",
        "vLLM's older flag: give --hf-overrides '{\"rope_scaling\": ...}'",
        accepts=_one_of(None),
    ),
    VllmFlag(
        "rope_theta",
        "vLLM's older flag: give --hf-overrides '{\"rope_theta\": ...}'",
        accepts=_one_of(None),
    ),
    VllmFlag("scheduler_cls", "Baton's scheduler is its own", accepts=_one_of(None)),
    VllmFlag("worker_cls", "Baton's workers are its own", accepts=_one_of(None, "auto")),
    VllmFlag("worker_extension_cls", "Baton's workers are its own", accepts=_one_of(None, "")),
    VllmFlag("additional_config", "no platform plugins", accepts=lambda v: not v or v == "{}"),
    VllmFlag(
        "enable_eplb", "each rank holds a share of every expert: none to balance", False, bool
    ),
    VllmFlag("data_parallel_size_local", _DATA_PARALLEL, None, int, lambda v: v in (None, 1)),
    VllmFlag("data_parallel_start_rank", _DATA_PARALLEL, None, int, lambda v: v in (None, 0)),
    VllmFlag("data_parallel_address", _DATA_PARALLEL, accepts=_one_of(None)),
    VllmFlag("data_parallel_rpc_port", _DATA_PARALLEL, None, int, _one_of(None)),
    VllmFlag("data_parallel_backend", _DATA_PARALLEL, "mp", accepts=_one_of("mp")),
    VllmFlag(
        "io_processor_plugin",
        "input/output processor plugins are not supported",
        accepts=_one_of(None),
    ),
)

FRONTEND_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("disable_log_requests", _REQUEST_LOGS, False, bool),
    VllmFlag("enable_log_requests", _REQUEST_LOGS, False, bool),
    VllmFlag("enable_log_outputs", _REQUEST_LOGS, False, bool),
    VllmFlag("max_log_len", _REQUEST_LOGS, None, int),
    VllmFlag("log_error_stack", "errors are logged with their stack", False, bool),
    VllmFlag("disable_fastapi_docs", "the gateway serves no /docs or /redoc", False, bool),
    VllmFlag(
        "enable_prompt_tokens_details",
        "usage carries prompt_tokens_details.cached_tokens whenever prompt tokens were cached",
        False,
        bool,
    ),
    VllmFlag(
        "enable_server_load_tracking",
        "GET /load always reports the requests the gateway is serving",
        False,
        bool,
    ),
    VllmFlag("allowed_local_media_path", "Baton serves text-only models: no media is read"),
    VllmFlag(
        "tool_parser_plugin",
        "tool parsers are Baton's own (--tool-call-parser)",
        accepts=_one_of(None, ""),
    ),
    VllmFlag(
        "api_server_count",
        "one gateway serves HTTP (it is asynchronous; tokenization is cheap beside the workers)",
        1,
        int,
        _one_of(1),
    ),
    VllmFlag("disable_frontend_multiprocessing", "the gateway is its own process", False, bool),
    VllmFlag(
        "enable_reasoning", "reasoning is on whenever --reasoning-parser is given", False, bool
    ),
    VllmFlag("h11_max_incomplete_event_size", "uvicorn's defaults", None, int),
    VllmFlag("h11_max_header_count", "uvicorn's defaults", None, int),
    VllmFlag("enable_ssl_refresh", "certificates are read at start", False, bool),
    VllmFlag("log_config_file", "Baton's services log to stderr in their own format"),
    VllmFlag("tool_server", "built-in tools are not supported", accepts=_one_of(None)),
    VllmFlag(
        "headless",
        "a Baton stack always has its gateway (run the workers alone with baton decode / "
        "baton prefill)",
        False,
        bool,
        _one_of(False),
    ),
)


# vLLM's LLM(...) arguments that are flags of Baton's services (baton serve passes them on)
LLM_ONLY_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag("disable_log_stats", "the offline engine logs no periodic statistics", True, bool),
)


def add_flags(parser: argparse.ArgumentParser, flags: Iterable[VllmFlag]) -> None:
    """The flags on ``parser``, in a group of their own."""
    group = parser.add_argument_group(
        "vLLM flags",
        "accepted so that vLLM command lines run unchanged; each says what Baton does instead",
    )
    for f in flags:
        if f.kind is bool:
            group.add_argument(
                f.flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.note
            )
        else:
            group.add_argument(
                f.flag, *f.aliases, type=f.kind, nargs=f.nargs, default=f.default, help=f.note
            )


def check_flags(
    values: Mapping[str, Any], flags: Iterable[VllmFlag], spelling: str = "flag"
) -> list[str]:
    """Raise ``InvalidRequestError`` for a flag in ``values`` whose value Baton cannot serve;
    log (and return) a note for each other one given a value other than vLLM's default.
    ``spelling``: "flag" (``--swap-space``) or "arg" (``swap_space``) in the messages."""
    notes = []
    for f in flags:
        if f.name not in values:
            continue
        value = values[f.name]
        shown = f.flag if spelling == "flag" else f.name
        if f.accepts is not None and not f.accepts(value):
            raise InvalidRequestError(f"{shown} {value!r} is not supported: {f.note}")
        if value != f.default:
            notes.append(f"{shown} has no effect in Baton: {f.note}")
    for note in notes:
        logger.info("%s", note)
    return notes


def take_engine_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(...)``'s keyword arguments without vLLM's engine flags of :data:`ENGINE_FLAGS`
    (checked as :func:`check_flags` does)."""
    flags = ENGINE_FLAGS + LLM_ONLY_FLAGS
    given = {f.name: kwargs.pop(f.name) for f in flags if f.name in kwargs}
    check_flags(given, flags, spelling="arg")
    return kwargs

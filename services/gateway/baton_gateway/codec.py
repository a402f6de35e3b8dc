"""The gateway's only bridge to ``baton.v1`` protos: OpenAI requests in, internal types out.

Nothing else in the gateway builds or reads ``*_pb2`` messages field by field. Every sampling
field is set explicitly (the decode worker maps proto3's zero defaults of ``top_p``,
``repetition_penalty`` and ``max_tokens`` to "disabled"; we never rely on that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from baton.v1 import common_pb2, engine_pb2
from baton_gateway.protocol import ChatCompletionRequest, CompletionRequest, StructuredOutputsSpec
from baton_gateway.tensor_file import RawTensor

_INT32_MAX = 2**31 - 1

_FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one sampled token and the top-N alternatives (best first)."""

    token_id: int
    logprob: float
    rank: int  # of the sampled token, 1 = most likely
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), N entries


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """One ``GenerateResponse``: the tokens sampled since the previous one."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token, when asked for
    finish_reason: str | None  # "stop" | "length" | "abort" on the last chunk, else None
    stop_token_id: int | None  # the stop token id that ended it (never an EOS)
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., first chunk only


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    metrics_url: str  # "" when the worker serves no metrics
    block_size: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()  # the LoRA adapters it serves: (name, path)
    labels: tuple[str, ...] = ()  # a sequence-classification model's; () for a causal LM


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    max_num_seqs: int


# vLLM's defaults for the sampling params a request may leave unset.
_UNSET_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def sampling_params(
    request: ChatCompletionRequest | CompletionRequest,
    max_tokens: int,
    seed: int | None,
    defaults: dict[str, Any] | None = None,
    reasoning_end: str | None = None,
    bad_words: list[list[int]] | None = None,
) -> common_pb2.SamplingParams:
    """The worker's sampling params for one sequence of ``request``.

    ``max_tokens`` is the gateway's final budget (already checked against the context);
    ``seed`` is the sequence's own seed (``request.seed + index`` for ``n`` > 1); ``defaults``
    fill what the request leaves unset (the model's generation config), else vLLM's defaults;
    ``reasoning_end``: a structured output applies after the reasoning that ends with it;
    ``bad_words``: the token sequences of ``request.bad_words`` (the worker has no tokenizer).
    """
    unset = {**_UNSET_DEFAULTS, **(defaults or {})}

    def value(name: str) -> Any:
        given = getattr(request, name)
        return unset[name] if given is None else given

    pb = common_pb2.SamplingParams(
        temperature=value("temperature"),
        top_p=value("top_p"),
        # -1 or 0: disabled; one past the vocabulary is too, however large (int32 on the wire)
        top_k=min(max(value("top_k"), 0), _INT32_MAX),
        min_p=value("min_p"),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=value("repetition_penalty"),
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        # (an id past int32 is past every vocabulary: never sampled, as vLLM ignores it)
        stop_token_ids=[t for t in request.stop_token_ids or () if t <= _INT32_MAX],
        ignore_eos=request.ignore_eos,
        logit_bias=request.token_biases,
        allowed_token_ids=request.allowed_token_ids or [],
        bad_words=[common_pb2.TokenIds(token_ids=ids) for ids in bad_words or ()],
    )
    if seed is not None:
        pb.seed = seed
    if request.vllm_xargs:
        pb.extra_args = json.dumps(request.vllm_xargs)
    structured = request.structured
    if structured is not None:
        pb.structured_outputs.CopyFrom(structured_outputs(structured))
        if reasoning_end is not None:
            pb.structured_outputs.reasoning_end = reasoning_end
    num_logprobs = request.num_logprobs
    if num_logprobs is not None:
        pb.logprobs = num_logprobs
    # vLLM's prompt_logprobs, and an echoed prompt's logprobs: the worker computes the larger.
    wanted = [request.prompt_logprobs]
    if getattr(request, "echo", False):
        wanted.append(num_logprobs)
    prompt_logprobs = [n for n in wanted if n is not None]
    if prompt_logprobs:
        pb.prompt_logprobs = max(prompt_logprobs)
    return pb


def structured_outputs(spec: StructuredOutputsSpec) -> common_pb2.StructuredOutputs:
    pb = common_pb2.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.json_schema is not None:
        schema = spec.json_schema
        pb.json_schema = schema if isinstance(schema, str) else json.dumps(schema)
    elif spec.regex is not None:
        pb.regex = spec.regex
    elif spec.choice is not None:
        pb.choice.choices.extend(spec.choice)
    elif spec.grammar is not None:
        pb.grammar = spec.grammar
    elif spec.structural_tag is not None:
        tag = spec.structural_tag
        pb.structural_tag = tag if isinstance(tag, str) else json.dumps(tag)
    else:
        pb.json_object = True
    return pb


def generate_request(
    req_id: str,
    prompt_token_ids: list[int],
    sampling: common_pb2.SamplingParams,
    priority: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    prompt_embeds: RawTensor | None = None,
) -> engine_pb2.GenerateRequest:
    """A ``GenerateRequest`` for local prefill on the decode worker (aggregated mode);
    ``priority``: lower is served first (workers with ``--scheduling-policy priority``);
    ``lora_name``: the LoRA adapter (None: the base model); ``cache_salt``: vLLM's;
    ``prompt_embeds``: the prompt as input embeddings (then no ``prompt_token_ids``)."""
    request = engine_pb2.GenerateRequest(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling=sampling,
        priority=priority,
        lora_name=lora_name or "",
        cache_salt=cache_salt or "",
    )
    if prompt_embeds is not None:
        request.prompt_embeds.data = prompt_embeds.data
        request.prompt_embeds.dtype = prompt_embeds.dtype
        request.prompt_embeds.shape.extend(prompt_embeds.shape)
    return request


def num_prompt_tokens(request: engine_pb2.GenerateRequest) -> int:
    """The prompt's length: its tokens, or its embeddings' rows."""
    if request.HasField("prompt_embeds"):
        return request.prompt_embeds.shape[0] if request.prompt_embeds.shape else 0
    return len(request.prompt_token_ids)


def prefill_request(request: engine_pb2.GenerateRequest) -> engine_pb2.PrefillRequest:
    """The ``PrefillRequest`` for a sequence's ``GenerateRequest`` (remote prefill)."""
    return engine_pb2.PrefillRequest(
        req_id=request.req_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling=request.sampling,
        priority=request.priority,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
        prompt_embeds=request.prompt_embeds if request.HasField("prompt_embeds") else None,
    )


def prefill_chunk(
    pb: engine_pb2.PrefillResponse, request: engine_pb2.GenerateRequest
) -> GenerateChunk:
    """The first token a prefill worker sampled, as the sequence's first chunk."""
    lp = pb.first_token_logprobs
    finish_reason = _FINISH_REASONS.get(pb.finish_reason)
    first = pb.first_token_id
    stopped_by_id = finish_reason == "stop" and first in request.sampling.stop_token_ids
    return GenerateChunk(
        token_ids=[first],
        logprobs=[_token_logprob(lp)] if lp.token_ids else None,
        finish_reason=finish_reason,
        stop_token_id=first if stopped_by_id else None,
        num_prompt_tokens=num_prompt_tokens(request),
        num_cached_tokens=pb.num_cached_tokens,
    )


def remote_generate_request(
    request: engine_pb2.GenerateRequest, prefill: engine_pb2.PrefillResponse
) -> engine_pb2.GenerateRequest:
    """``request`` continued on a decode worker from the prefill worker's first token + KV."""
    out = engine_pb2.GenerateRequest()
    out.CopyFrom(request)
    out.first_token_id = prefill.first_token_id
    if prefill.first_token_logprobs.token_ids:
        out.first_token_logprobs.CopyFrom(prefill.first_token_logprobs)
    out.kv_handle.CopyFrom(prefill.kv_handle)
    return out


@dataclass(frozen=True, slots=True)
class Embedded:
    """One input's embedding, as a worker computed it."""

    values: list[float]
    num_prompt_tokens: int
    num_cached_tokens: int


def embed_request(
    req_id: str,
    prompts: list[list[int]],
    priority: int = 0,
    dimensions: int | None = None,
    normalize: bool | None = None,
    lora_name: str | None = None,
    activation: bool | None = None,
) -> engine_pb2.EmbedRequest:
    pb = engine_pb2.EmbedRequest(
        req_id=req_id,
        inputs=[common_pb2.TokenIds(token_ids=ids) for ids in prompts],
        priority=priority,
        lora_name=lora_name or "",
    )
    if dimensions is not None:
        pb.dimensions = dimensions
    if normalize is not None:
        pb.normalize = normalize
    if activation is not None:
        pb.activation = activation
    return pb


def embedded(pb: engine_pb2.EmbedResponse) -> list[Embedded]:
    return [
        Embedded(list(e.values), e.num_prompt_tokens, e.num_cached_tokens) for e in pb.embeddings
    ]


def abort_request(req_ids: list[str]) -> engine_pb2.AbortRequest:
    return engine_pb2.AbortRequest(req_ids=req_ids)


def _token_logprob(pb: common_pb2.TokenLogprobs) -> TokenLogprob:
    ids, values = pb.token_ids, pb.logprobs
    return TokenLogprob(
        token_id=ids[0],
        logprob=values[0],
        rank=pb.rank,
        top=tuple(zip(ids[1:], values[1:], strict=True)),
    )


def generate_chunk(pb: engine_pb2.GenerateResponse) -> GenerateChunk:
    """Decode one streamed ``GenerateResponse``."""
    return GenerateChunk(
        token_ids=list(pb.token_ids),
        logprobs=[_token_logprob(lp) for lp in pb.logprobs] if pb.logprobs else None,
        finish_reason=_FINISH_REASONS.get(pb.finish_reason),
        stop_token_id=pb.stop_token_id if pb.HasField("stop_token_id") else None,
        num_prompt_tokens=pb.num_prompt_tokens,
        num_cached_tokens=pb.num_cached_tokens,
        prompt_logprobs=(
            [_token_logprob(lp) for lp in pb.prompt_logprobs] if pb.prompt_logprobs else None
        ),
    )


def model_info(pb: engine_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(
        model=pb.model,
        max_model_len=pb.max_model_len,
        vocab_size=pb.vocab_size,
        eos_token_ids=tuple(pb.eos_token_ids),
        metrics_url=pb.metrics_url,
        block_size=pb.block_size or 16,
        lora_modules=tuple((m.name, m.path) for m in pb.lora_modules),
        labels=tuple(pb.labels),
    )


def worker_load(pb: engine_pb2.GetLoadResponse) -> WorkerLoad:
    load = pb.load
    return WorkerLoad(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_cache_usage=load.kv_cache_usage,
        max_num_seqs=load.max_num_seqs,
    )


def get_model_info_request() -> engine_pb2.GetModelInfoRequest:
    return engine_pb2.GetModelInfoRequest()


def get_load_request() -> engine_pb2.GetLoadRequest:
    return engine_pb2.GetLoadRequest()

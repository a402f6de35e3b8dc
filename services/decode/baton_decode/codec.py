"""The decode worker's only bridge between ``baton.v1`` protos and the engine's own types.

Nothing else in the worker builds or reads ``*_pb2`` messages field by field, and nothing in the
engine imports them (the prefill worker's codec builds on this one). Decoding raises
``InvalidRequestError`` (the engine's message, meant for the client); encoding never fails.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from baton.v1 import common_pb2, engine_pb2
from baton_engine import prompt_embeds
from baton_engine.core.engine_core import EngineCore, EngineStats
from baton_engine.core.outputs import EngineCoreOutput, TokenLogprobs
from baton_engine.errors import InvalidRequestError
from baton_engine.json_args import json_object
from baton_engine.pooling_params import PoolingParams
from baton_engine.sampling_params import SamplingParams, StructuredOutputsParams
from baton_kvtransfer.handle import KVHandle

FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


@dataclass(frozen=True)
class GenerateInput:
    """A decoded ``GenerateRequest``: what the engine needs to run it. Disaggregated requests
    carry the first token the prefill worker sampled and where the prompt's KV lives."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    first_token_id: int | None = None
    kv_handle: KVHandle | None = None
    priority: int = 0  # lower first under the priority scheduling policy
    lora_name: str | None = None  # the LoRA adapter, by the name the worker serves it under
    cache_salt: str | None = None  # shares prefix-cache blocks only with the same salt
    # The prompt as input embeddings (then ``prompt_token_ids`` is empty until the worker
    # gives it its rows' ids: ``EngineCore.embeds_prompt``)
    prompt_embeds: torch.Tensor | None = None

    @property
    def num_prompt_tokens(self) -> int:
        if self.prompt_embeds is not None:
            return int(self.prompt_embeds.shape[0]) if self.prompt_embeds.dim() else 0
        return len(self.prompt_token_ids)


def prompt_embeds_from_proto(
    pb: common_pb2.PromptEmbeds, prompt_token_ids: Sequence[int]
) -> torch.Tensor:
    """A prompt's input embeddings (with no ``prompt_token_ids``: one or the other)."""
    if prompt_token_ids:
        raise InvalidRequestError("a prompt is either token ids or prompt_embeds")
    return prompt_embeds.from_raw(pb.data, pb.dtype, tuple(pb.shape))


def sampling_params_from_proto(pb: common_pb2.SamplingParams) -> SamplingParams:
    """Map the wire sampling params onto the engine's.

    The gateway sets every field explicitly, so values map one to one, except the three whose
    proto3 default (0) is not a meaningful value: ``max_tokens`` 0 means up to ``max_model_len``
    (None), ``top_p`` 0 and ``repetition_penalty`` 0 mean disabled (1.0); an empty
    ``logit_bias``, ``allowed_token_ids`` or ``bad_words`` means none (``bad_words`` come as
    the gateway tokenized them: ``bad_words_token_ids``). ``seed`` and ``logprobs`` are
    ``optional`` fields: unset means None; ``extra_args`` come as JSON text. Raises
    ``InvalidRequestError`` for values the engine rejects.
    """
    return SamplingParams(
        temperature=pb.temperature,
        top_p=pb.top_p or 1.0,
        top_k=pb.top_k,
        min_p=pb.min_p,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        repetition_penalty=pb.repetition_penalty or 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        max_tokens=pb.max_tokens or None,
        min_tokens=pb.min_tokens,
        stop_token_ids=list(pb.stop_token_ids),
        ignore_eos=pb.ignore_eos,
        logprobs=pb.logprobs if pb.HasField("logprobs") else None,
        prompt_logprobs=pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None,
        structured_outputs=(
            structured_outputs_from_proto(pb.structured_outputs)
            if pb.HasField("structured_outputs")
            else None
        ),
        logit_bias=dict(pb.logit_bias) or None,
        allowed_token_ids=list(pb.allowed_token_ids) or None,
        bad_words_token_ids=[list(seq.token_ids) for seq in pb.bad_words] or None,
        extra_args=json_object("extra_args", pb.extra_args) or None,
    )


def structured_outputs_from_proto(pb: common_pb2.StructuredOutputs) -> StructuredOutputsParams:
    kind = pb.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_outputs names no kind")
    spec: dict[str, Any] = {}
    if kind == "json_schema":
        spec["json"] = pb.json_schema
    elif kind == "choice":
        spec["choice"] = list(pb.choice.choices)
    else:
        spec[kind] = getattr(pb, kind)
    return StructuredOutputsParams(
        **spec,
        disable_any_whitespace=pb.disable_any_whitespace,
        reasoning_end=pb.reasoning_end or None,
    )


def generate_input_from_proto(pb: engine_pb2.GenerateRequest) -> GenerateInput:
    """Decode a ``GenerateRequest``.

    An empty ``req_id`` gets a fresh one. Prompt validity (empty, too long, ids out of range) is
    the engine's to check. ``first_token_id`` and ``kv_handle`` come together (remote prefill),
    and the handle must cover exactly the prompt.
    """
    prompt = list(pb.prompt_token_ids)
    remote = pb.HasField("kv_handle")
    if remote != pb.HasField("first_token_id"):
        raise InvalidRequestError("first_token_id and kv_handle must be given together")
    inp = GenerateInput(
        req_id=pb.req_id or uuid.uuid4().hex,
        prompt_token_ids=prompt,
        params=sampling_params_from_proto(pb.sampling),
        first_token_id=pb.first_token_id if remote else None,
        kv_handle=kv_handle_from_proto(pb.kv_handle) if remote else None,
        priority=pb.priority,
        lora_name=pb.lora_name or None,
        cache_salt=pb.cache_salt or None,
        prompt_embeds=(
            prompt_embeds_from_proto(pb.prompt_embeds, prompt)
            if pb.HasField("prompt_embeds")
            else None
        ),
    )
    handle = inp.kv_handle
    if handle is not None and handle.num_tokens != inp.num_prompt_tokens:
        raise InvalidRequestError(
            f"the KV handle covers {handle.num_tokens} tokens, the prompt has "
            f"{inp.num_prompt_tokens}"
        )
    return inp


def embed_input_from_proto(
    pb: engine_pb2.EmbedRequest,
) -> tuple[list[list[int]], PoolingParams]:
    """An ``EmbedRequest``'s inputs and their pooling params (unset ``normalize``: true)."""
    if not pb.inputs:
        raise InvalidRequestError("an embed request needs at least one input")
    params = PoolingParams(
        dimensions=pb.dimensions if pb.HasField("dimensions") else None,
        normalize=pb.normalize if pb.HasField("normalize") else None,
        activation=pb.activation if pb.HasField("activation") else None,
    )
    return [list(i.token_ids) for i in pb.inputs], params


def embedding_to_proto(out: EngineCoreOutput, num_prompt_tokens: int) -> engine_pb2.Embedding:
    return engine_pb2.Embedding(
        values=out.pooled or [],
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
    )


def kv_handle_from_proto(pb: common_pb2.KVHandle) -> KVHandle:
    if not pb.transfer_endpoint or not pb.lease_id:
        raise InvalidRequestError("the KV handle has no transfer endpoint or lease id")
    return KVHandle(
        worker_id=pb.worker_id,
        engine_id=pb.engine_id,
        epoch=pb.epoch,
        transfer_endpoint=pb.transfer_endpoint,
        block_ids=tuple(pb.block_ids),
        block_hashes=tuple(pb.block_hashes),
        num_tokens=pb.num_tokens,
        lease_id=pb.lease_id,
        lease_expiry_unix_ms=pb.lease_expiry_unix_ms,
        compat_hash=pb.compat_hash,
    )


def kv_handle_to_proto(handle: KVHandle) -> common_pb2.KVHandle:
    return common_pb2.KVHandle(
        worker_id=handle.worker_id,
        engine_id=handle.engine_id,
        epoch=handle.epoch,
        transfer_endpoint=handle.transfer_endpoint,
        block_ids=handle.block_ids,
        block_hashes=handle.block_hashes,
        num_tokens=handle.num_tokens,
        lease_id=handle.lease_id,
        lease_expiry_unix_ms=handle.lease_expiry_unix_ms,
        compat_hash=handle.compat_hash,
    )


def token_logprobs_to_proto(lp: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(token_ids=lp.token_ids, logprobs=lp.logprobs, rank=lp.rank)


def generate_response_to_proto(
    outputs: Sequence[EngineCoreOutput], num_prompt_tokens: int
) -> engine_pb2.GenerateResponse:
    """Merge the outputs one request produced since the last message into one message.

    ``outputs`` are in step order and only the last may be finished. The finish reason and stop
    token id come from the last one; ``stop_token_id`` is set only when one of the request's
    ``stop_token_ids`` ended it (an EOS stop leaves it unset, as vLLM's ``stop_reason``).
    ``num_prompt_tokens`` and ``num_cached_tokens`` are set on every message, the last included.
    """
    msg = engine_pb2.GenerateResponse(num_prompt_tokens=num_prompt_tokens)
    for out in outputs:
        if out.prompt_logprobs:
            msg.prompt_logprobs.extend(token_logprobs_to_proto(lp) for lp in out.prompt_logprobs)
        msg.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            msg.logprobs.extend(token_logprobs_to_proto(lp) for lp in out.new_logprobs)
    last = outputs[-1]
    msg.num_cached_tokens = max(last.num_cached_tokens, 0)
    if last.finish_reason is not None:
        msg.finish_reason = FINISH_REASONS[last.finish_reason]
        if isinstance(last.stop_reason, int):
            msg.stop_token_id = last.stop_reason
    return msg


def load_to_proto(
    stats: EngineStats, num_pending: int, max_num_seqs: int
) -> engine_pb2.GetLoadResponse:
    """The worker's load: ``num_pending`` requests accepted by the worker and not finished count
    as waiting when the engine has not taken them in yet (they arrived during a step)."""
    num_waiting = max(stats.num_waiting, num_pending - stats.num_running)
    return engine_pb2.GetLoadResponse(
        load=common_pb2.WorkerLoad(
            num_running=stats.num_running,
            num_waiting=num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            max_num_seqs=max_num_seqs,
        )
    )


def model_info_to_proto(
    core: EngineCore, served_model_name: str, metrics_url: str
) -> engine_pb2.GetModelInfoResponse:
    mc = core.model_config
    return engine_pb2.GetModelInfoResponse(
        model=served_model_name,
        max_model_len=core.max_model_len,
        vocab_size=mc.vocab_size,
        block_size=core.config.block_size,
        eos_token_ids=list(mc.eos_token_ids),
        dtype=str(core.dtype).removeprefix("torch."),
        metrics_url=metrics_url,
        lora_modules=[
            engine_pb2.LoRAModule(
                name=lora.lora_name, path=lora.lora_path, base_model_name=lora.base_model_name
            )
            for lora in core.lora_modules.values()
        ],
        labels=list(mc.labels),
    )

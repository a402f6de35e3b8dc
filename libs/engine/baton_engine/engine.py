"""LLMEngine: EngineCore plus tokenizer and incremental detokenizers; text in, RequestOutput out.

``n > 1`` runs as sibling requests in the core (``<id>#<i>``); they share the prompt's blocks
through the prefix cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput, TokenLogprobs
from baton_engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from baton_engine.errors import EngineSleepingError, InvalidRequestError
from baton_engine.lora import LoRARequest
from baton_engine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
    SampleLogprobs,
)
from baton_engine.pooling_params import PoolingParams
from baton_engine.request import RequestStatus
from baton_engine.sampling_params import SamplingParams, tokenize_bad_words, truncate_prompt


@dataclass
class _Sequence:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None  # None: detokenize=False


@dataclass
class _RequestState:
    output: RequestOutput
    sequences: dict[str, _Sequence] = field(default_factory=dict)  # child req_id -> sequence

    @property
    def finished(self) -> bool:
        return all(s.output.finished() for s in self.sequences.values())


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.tokenizer: Any = self.core.load_tokenizer()
        self._requests: dict[str, _RequestState] = {}  # request_id -> state
        self._child_to_parent: dict[str, str] = {}  # child req_id -> request_id
        self._embeddings: dict[str, list[int]] = {}  # embedding request_id -> its prompt

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt).input_ids)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int] | torch.Tensor | Mapping[str, Any],
        params: SamplingParams | PoolingParams,
        prompt_token_ids: Sequence[int] | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; ``prompt_token_ids``, when given, is the already-encoded ``prompt``
        (``params.truncate_prompt_tokens`` keeps its last tokens). ``prompt`` may be a dict as
        vLLM's: ``{"prompt": text}``, ``{"prompt_token_ids": ids}`` or ``{"prompt_embeds":
        tensor}``, with a ``"cache_salt"``; a tensor is the prompt's input embeddings
        (``enable_prompt_embeds``).
        ``priority`` (lower first) needs ``scheduling_policy="priority"``; siblings share it,
        ``lora_request`` (a LoRA adapter; the engine needs ``enable_lora``) and ``cache_salt``
        (vLLM's: prefix-cache blocks are shared only with requests of the same salt).
        With ``PoolingParams`` it is an embedding request: ``step`` returns its
        ``EmbeddingRequestOutput`` once its prompt is computed."""
        if request_id in self._requests or request_id in self._embeddings:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if self.core.is_paused():  # (offline, a held request would wait forever)
            raise EngineSleepingError("the engine is paused (sleep level 0): wake_up() first")
        if isinstance(prompt, Mapping):
            cache_salt = check_salt(prompt.get("cache_salt")) if cache_salt is None else cache_salt
            prompt = parse_prompt(prompt)
        text = prompt if isinstance(prompt, str) else None
        embeds = None
        if isinstance(prompt, torch.Tensor):
            embeds, token_ids = truncate_embeds(prompt, params, self.max_model_len), []
        elif prompt_token_ids is not None:
            token_ids = list(prompt_token_ids)
        else:
            token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        if isinstance(params, PoolingParams):
            self.core.add_request(
                request_id,
                token_ids,
                params,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                prompt_embeds=embeds,
            )
            self._embeddings[request_id] = token_ids
            return
        params = self.tokenize_bad_words(params)
        self.core.validate_request(token_ids, params, priority, lora_request, embeds)
        state = _RequestState(RequestOutput(request_id, text, token_ids))
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            child_params = params
            if params.n > 1:
                # Seeded siblings must differ from each other, yet be reproducible.
                seed = None if params.seed is None else params.seed + i
                child_params = replace(params, n=1, seed=seed)
            self.core.add_request(
                child_id,
                token_ids,
                child_params,
                priority=priority,
                lora_request=lora_request,
                cache_salt=cache_salt,
                prompt_embeds=embeds,
            )
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer,
                    token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
            cumulative = 0.0 if params.logprobs is not None else None
            state.sequences[child_id] = _Sequence(
                CompletionOutput(i, "", [], cumulative, logprobs), detok
            )
            self._child_to_parent[child_id] = request_id
        self._requests[request_id] = state

    def tokenize_bad_words(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its ``bad_words`` as token sequences (``bad_words_token_ids``) by
        this engine's tokenizer; ``params`` itself when it has none or already has them."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        return replace(
            params, bad_words_token_ids=tokenize_bad_words(params.bad_words, self.tokenizer)
        )

    def abort_request(self, request_id: str) -> None:
        if self._embeddings.pop(request_id, None) is not None:
            self.core.abort_requests([request_id])
            return
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        self.core.abort_requests(state.sequences)
        for child_id in state.sequences:
            self._child_to_parent.pop(child_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests or self._embeddings)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one engine step; return the requests that finished in it."""
        finished: list[RequestOutput | EmbeddingRequestOutput] = []
        for out in self.core.step():
            if out.req_id in self._embeddings:
                if out.finished:
                    prompt = self._embeddings.pop(out.req_id)
                    assert out.pooled is not None, f"embedding {out.req_id} ended unpooled"
                    embedding = EmbeddingOutput(out.pooled)
                    finished.append(
                        EmbeddingRequestOutput(
                            out.req_id, embedding, prompt, num_cached_tokens=out.num_cached_tokens
                        )
                    )
                continue
            parent_id = self._child_to_parent[out.req_id]
            state = self._requests[parent_id]
            if out.prompt_logprobs is not None and state.output.prompt_logprobs is None:
                state.output.prompt_logprobs = [
                    None,
                    *(self._to_logprob_dict(lp) for lp in out.prompt_logprobs),
                ]
            self._process(state.sequences[out.req_id], out)
            if state.sequences[out.req_id].output.finished():
                del self._child_to_parent[out.req_id]
                if state.finished:
                    del self._requests[parent_id]
                    state.output.finished = True
                    state.output.outputs = [s.output for s in state.sequences.values()]
                    state.output.num_cached_tokens = out.num_cached_tokens
                    finished.append(state.output)
        return finished

    def _process(self, seq: _Sequence, out: EngineCoreOutput) -> None:
        completion = seq.output
        new_ids = out.new_token_ids
        delta = DetokenizerDelta("")
        detok = seq.detokenizer
        if detok is not None:  # (None: detokenize=False)
            at_stop = out.finished and out.finish_reason == "stop"
            if len(new_ids) > 1 and detok.stops:
                # A step's several tokens (speculative decoding, multi-step scheduling): token
                # by token, to end at the one that completes a stop string, as the gateway does.
                parts = []
                for i, token_id in enumerate(new_ids):
                    last = i == len(new_ids) - 1
                    delta = detok.update((token_id,), out.finished and last, at_stop and last)
                    parts.append(delta.text)
                    if delta.stop_str is not None:
                        new_ids = new_ids[: i + 1]
                        break
                delta = DetokenizerDelta("".join(parts), delta.stop_str)
            else:
                delta = detok.update(new_ids, final=out.finished, stop_terminated=at_stop)
        completion.token_ids.extend(new_ids)
        if out.new_logprobs is not None and completion.logprobs is not None:
            for lp in out.new_logprobs[: len(new_ids)]:
                completion.logprobs.append(self._to_logprob_dict(lp))
                completion.cumulative_logprob = (
                    completion.cumulative_logprob or 0.0
                ) + lp.logprobs[0]
        completion.text += delta.text
        if delta.stop_str is not None and not out.finished:
            self.core.abort_requests([out.req_id], RequestStatus.FINISHED_STOPPED)
        if delta.stop_str is not None:
            completion.finish_reason, completion.stop_reason = "stop", delta.stop_str
        elif out.finished:
            completion.finish_reason, completion.stop_reason = out.finish_reason, out.stop_reason

    def _to_logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entries: dict[int, Logprob] = {}
        for rank, (token_id, value) in enumerate(zip(lp.token_ids, lp.logprobs, strict=True)):
            if token_id in entries:
                continue
            entries[token_id] = Logprob(
                value, lp.rank if rank == 0 else rank, self.tokenizer.decode([token_id])
            )
        return entries


def truncate_embeds(
    embeds: torch.Tensor, params: SamplingParams | PoolingParams, max_model_len: int
) -> torch.Tensor:
    """``truncate_prompt`` for a prompt given as embeddings: its last rows."""
    keep = params.truncate_prompt_tokens
    if keep is None or embeds.dim() < 2:
        return embeds
    keep = max_model_len if keep == -1 else keep
    return embeds[..., -keep:, :]


_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "prompt_embeds", "cache_salt"})


def parse_prompt(given: object) -> str | list[int] | torch.Tensor:
    """One prompt as vLLM takes it (a string, or a dict: ``{"prompt": text}``,
    ``{"prompt_token_ids": ids}`` or ``{"prompt_embeds": tensor}``, its ``cache_salt`` aside)
    as text, token ids or input embeddings. Raises InvalidRequestError."""
    if isinstance(given, str):
        return given
    if isinstance(given, Mapping) and given.keys() - _PROMPT_KEYS:
        extra = ", ".join(sorted(given.keys() - _PROMPT_KEYS))
        raise InvalidRequestError(
            f"prompts with {extra} are not supported (Baton serves text-only models)"
        )
    if isinstance(given, Mapping) and "prompt_token_ids" in given:
        return list(given["prompt_token_ids"])
    if isinstance(given, Mapping) and "prompt_embeds" in given:
        embeds = given["prompt_embeds"]
        if not isinstance(embeds, torch.Tensor):
            raise InvalidRequestError(
                f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}"
            )
        return embeds
    if isinstance(given, Mapping) and isinstance(given.get("prompt"), str):
        return str(given["prompt"])
    raise InvalidRequestError(
        "a prompt is a string, {'prompt': '...'}, {'prompt_token_ids': [...]} or "
        "{'prompt_embeds': tensor}, got " + type(given).__name__
    )


def check_salt(salt: object) -> str | None:
    """A prompt's ``cache_salt`` (None: none), or InvalidRequestError."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequestError("a prompt's cache_salt must be a non-empty string")
    return salt

"""The offline API, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal, NotRequired, TypedDict, TypeVar, overload

import torch
from tqdm.auto import tqdm

from baton_engine import beam_search
from baton_engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import check_pause_mode
from baton_engine.engine import LLMEngine, check_salt, parse_prompt, truncate_embeds
from baton_engine.errors import InvalidRequestError
from baton_engine.lora import LoRARequest
from baton_engine.model_files import generation_defaults
from baton_engine.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from baton_engine.pooling_params import (
    PoolingParams,
    cosine_similarity,
    pair_token_ids,
    score_pairs,
)
from baton_engine.sampling_params import MAX_LOGPROBS, SamplingParams, truncate_prompt
from baton_engine.vllm_flags import take_engine_args


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    # vLLM's: shares prefix-cache blocks only with prompts of the same salt
    cache_salt: NotRequired[str]


class TextPrompt(TypedDict):
    prompt: str
    cache_salt: NotRequired[str]


class EmbedsPrompt(TypedDict):
    # the prompt's input embeddings, [length, hidden size] (the engine needs
    # enable_prompt_embeds; generate only)
    prompt_embeds: torch.Tensor
    cache_salt: NotRequired[str]


PromptType = str | TextPrompt | TokensPrompt | EmbedsPrompt
_P = TypeVar("_P", SamplingParams, PoolingParams)
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None
ChatMessages = list[dict[str, Any]]


class LLM:
    """An engine for offline batch generation.

    ``LLM()`` serves the default model (SmolLM2-135M-Instruct); engine arguments keep vLLM's
    names (``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``block_size``,
    ``enable_prefix_caching``, ``dtype``, ``kv_cache_memory``, ``load_format``, ...).
    ``generation_config`` and ``override_generation_config`` set the sampling params used when
    none are given (:meth:`get_default_sampling_params`), as in vLLM.
    """

    def __init__(
        self,
        model: str | None = None,
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        **engine_args: Any,
    ) -> None:
        # Checked first: a value out of range raises before the engine loads. (A GGUF, whose
        # converted folder may not exist yet, has no generation config to read.)
        self._default_params = generation_defaults(
            model, generation_config, override_generation_config
        )
        self.get_default_sampling_params()
        engine_args = take_engine_args(dict(engine_args))
        try:
            config = EngineConfig(model=model, **engine_args)
        except TypeError as e:
            raise InvalidRequestError(f"unknown engine argument: {e}") from None
        self.engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling params used when none are given: the model's generation config
        (``generation_config.json``: temperature, top_p, top_k, min_p, repetition_penalty,
        max_new_tokens), else SamplingParams' own defaults."""
        return SamplingParams(**self._default_params)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def shutdown(self) -> None:
        """Stop the engine's helper processes (``tensor_parallel_size`` > 1; they also end
        with this process)."""
        self.engine.core.shutdown()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come in the prompts' order. ``lora_request``: a
        LoRA adapter for every prompt, or one (or None) per prompt (the engine needs
        ``enable_lora``). ``priority``, one per prompt, ranks them when the engine runs
        ``scheduling_policy="priority"`` (lower is served first), as in vLLM."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompt_list = _prompt_list(prompts, embeds_ok=True)
        params = _params_list(sampling_params, SamplingParams, len(prompt_list))
        salts = _salt_list(prompts)
        outputs = self._run(prompt_list, params, use_tqdm, priority, lora_request, salts)
        return outputs  # type: ignore[return-value]  # (sampling params: RequestOutputs)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRAArg = None,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search`` (``beam_search.py``): per prompt, its ``beam_width`` best
        beams, best first. A sequence's ``tokens`` are the prompt's and the generated ones; its
        ``text`` is the generated tokens' (a final EOS's only with
        ``include_stop_str_in_output``). A beam that reaches ``max_model_len`` stops there
        ("length")."""
        width = params.beam_width
        if 2 * width > MAX_LOGPROBS:
            raise InvalidRequestError(
                f"beam_width must be at most {MAX_LOGPROBS // 2} (each step reads the top "
                f"2 * beam_width logprobs, at most {MAX_LOGPROBS}), got {width}"
            )
        prompt_list = _prompt_list(prompts)
        engine = self.engine
        encoded = [engine.encode(p) if isinstance(p, str) else p for p in prompt_list]
        loras = _lora_list(lora_request, len(encoded))
        step = SamplingParams(
            max_tokens=1, temperature=params.temperature, logprobs=2 * width, ignore_eos=True
        )
        for ids in encoded:
            engine.core.validate_request(ids, step)
        eos = frozenset(engine.core.model_config.eos_token_ids)
        live = [[BeamSearchSequence(tokens=list(ids))] for ids in encoded]
        completed: list[list[BeamSearchSequence]] = [[] for _ in encoded]
        for _ in tqdm(range(params.max_tokens), desc="Beam search", disable=not use_tqdm):
            for i, beams in enumerate(live):  # (a beam at the context's end cannot grow)
                full = [b for b in beams if len(b.tokens) >= engine.max_model_len]
                for beam in full:
                    beam.finish_reason = "length"
                completed[i] += full
                live[i] = [b for b in beams if len(b.tokens) < engine.max_model_len]
            batch = [(i, beam) for i, beams in enumerate(live) for beam in beams]
            if not batch:
                break
            outs = self._run(
                [list(beam.tokens) for _, beam in batch],
                [step] * len(batch),
                use_tqdm=False,
                lora_request=[loras[i] for i, _ in batch],
            )
            tops: list[list[Any]] = [[] for _ in encoded]
            for (i, _), out in zip(batch, outs, strict=True):
                assert isinstance(out, RequestOutput)
                logprobs = out.outputs[0].logprobs
                tops[i].append(logprobs[0] if logprobs else None)
            for i in range(len(encoded)):
                live[i] = beam_search.expand(live[i], tops[i], params, eos, completed[i])
        tok = engine.tokenizer
        results = []
        for ids, beams, done in zip(encoded, live, completed, strict=True):
            ranked = beam_search.best(beams, done, params, eos)
            for beam in ranked:
                generated = beam.tokens[len(ids) :]
                if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                    generated = generated[:-1]
                beam.text = tok.decode(generated, skip_special_tokens=True)
            results.append(BeamSearchOutput(ranked))
        return results

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        priority: Sequence[int] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (``outputs.embedding``): the final hidden state
        at the prompt's last token, L2-normalized (``PoolingParams``), as vLLM's ``embed``
        with last-token pooling. Any model of the engine embeds but a sequence-classification
        model (:meth:`classify`); no pooling runner is needed."""
        if self._classifies:
            raise InvalidRequestError(
                "this is a sequence-classification model: use classify (or score), not embed"
            )
        return self._pool(
            prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority
        )

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        priority: Sequence[int] | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence-classification model's class probabilities per prompt, in order
        (``outputs.probs``, one per label of the model's ``id2label``): its head on the final
        hidden state at the prompt's last token, then softmax (sigmoid with one label);
        ``PoolingParams(activation=False)`` gives the head's logits. As vLLM's ``classify``."""
        if not self._classifies:
            raise InvalidRequestError(
                "this model is not a sequence-classification model (an architecture "
                "*ForSequenceClassification): it cannot classify"
            )
        return [
            ClassificationRequestOutput(
                o.request_id,
                ClassificationOutput(o.outputs.embedding),
                o.prompt_token_ids,
                num_cached_tokens=o.num_cached_tokens,
            )
            for o in self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority
            )
        ]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        priority: Sequence[int] | None = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's generic pooling: each prompt's pooler output as a tensor (``outputs.data``),
        as :meth:`embed` or :meth:`classify` computes it for this model. ``pooling_task``, when
        given, must be the model's: "embed", or "classify" for a sequence-classification
        model."""
        import torch

        task = "classify" if self._classifies else "embed"
        if pooling_task not in (None, "encode", task):
            raise InvalidRequestError(
                f"pooling_task {pooling_task!r} is not supported by this model (its task is "
                f"{task!r})"
            )
        return [
            PoolingRequestOutput(
                o.request_id,
                PoolingOutput(torch.tensor(o.outputs.embedding)),
                o.prompt_token_ids,
                num_cached_tokens=o.num_cached_tokens,
            )
            for o in self._pool(
                prompts, pooling_params, truncate_prompt_tokens, use_tqdm, lora_request, priority
            )
        ]

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cache entry (vLLM's), so the next prompts compute everything;
        False, changing nothing, while a request still holds blocks."""
        return self.engine.core.reset_prefix_cache()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Give the device's memory back until :meth:`wake_up` (vLLM's sleep mode; needs
        ``enable_sleep_mode=True`` and no request running): level 1 copies the weights to host
        memory, level 2 drops them (read again from the model's files on waking); both drop the
        KV cache (every cached prefix). Level 0 only pauses: requests are refused until
        :meth:`wake_up`. ``mode`` (vLLM's: what becomes of the requests in flight, of which
        an ``LLM`` between calls has none) is checked, no more."""
        check_pause_mode(mode)
        self.engine.core.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take back what :meth:`sleep` gave: ``tags`` "weights" and/or "kv_cache" (default
        both); generation runs again once both are awake."""
        self.engine.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.core.is_sleeping()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Record the engine's steps (every rank's) until :meth:`stop_profile` (vLLM's; needs
        ``profiler_config``, or ``$VLLM_TORCH_PROFILER_DIR``); ``profile_prefix`` starts the
        traces' names."""
        self.engine.core.start_profile(profile_prefix)

    def stop_profile(self) -> None:
        """Stop recording and write the traces (one a rank, into the profiler's folder)."""
        self.engine.core.stop_profile()

    def collective_rpc(
        self,
        method: str,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's call of a method on every worker; here the one method scripts call with
        sleep mode: ``"reload_weights"`` (the checkpoint read again in place, on every rank;
        one ``None`` a rank, as vLLM returns). Any other is an error naming it."""
        if method != "reload_weights" or args or kwargs:
            raise InvalidRequestError(
                f"collective_rpc({method!r}) with these arguments is not supported: Baton's "
                "workers answer only 'reload_weights' (no arguments)"
            )
        self.engine.core.reload_weights()
        return [None] * self.engine.core.config.tensor_parallel_size

    @property
    def _classifies(self) -> bool:
        return self.engine.core.model_config.is_classifier

    def _pool(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        lora_request: LoRAArg,
        priority: Sequence[int] | None,
    ) -> list[EmbeddingRequestOutput]:
        prompt_list = _prompt_list(prompts)
        params = _params_list(pooling_params or PoolingParams(), PoolingParams, len(prompt_list))
        if truncate_prompt_tokens is not None:
            params = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens) for p in params]
        salts = _salt_list(prompts)
        outputs = self._run(prompt_list, params, use_tqdm, priority, lora_request, salts)
        return outputs  # type: ignore[return-value]  # (pooling params: embeddings)

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRAArg = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or ``chat_template``),
        then generate. As vLLM's: ``continue_final_message`` continues the last message
        (without a generation prompt), ``tools`` reach the template, and
        ``chat_template_kwargs`` are the template's other arguments (``enable_thinking``...)."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        tok = self.engine.tokenizer
        prompts: list[str | list[int]] = []
        for conv in conversations:
            try:
                text = tok.apply_chat_template(
                    conv,
                    tools=tools,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template,
                    **(chat_template_kwargs or {}),
                )
            except Exception as e:  # jinja2's errors, transformers' ValueError, ...
                raise InvalidRequestError(f"cannot apply the chat template: {e}") from e
            prompts.append(list(tok(text, add_special_tokens=False).input_ids))
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _params_list(sampling_params, SamplingParams, len(prompts))
        return self._run(  # type: ignore[return-value]
            prompts, params, use_tqdm, lora_request=lora_request
        )

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``score``: per pair (one text against each of the other side's, or lists
        paired by position), the cosine similarity of the two texts' embeddings (each
        distinct text embedded once); a sequence-classification model with one label (a
        cross-encoder, a reranker) reads each pair as one input (``pair_token_ids``) and
        scores it with its head's sigmoid."""
        pairs = score_pairs(data_1, data_2)
        if self._classifies:
            return self._cross_encode(pairs, truncate_prompt_tokens, use_tqdm, pooling_params)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(
            zip(
                texts,
                self.embed(
                    texts,
                    pooling_params=pooling_params,
                    truncate_prompt_tokens=truncate_prompt_tokens,
                    use_tqdm=use_tqdm,
                ),
                strict=True,
            )
        )
        return [
            ScoringRequestOutput(
                str(next(self._counter)),
                ScoringOutput(
                    cosine_similarity(embedded[a].outputs.embedding, embedded[b].outputs.embedding)
                ),
                embedded[a].prompt_token_ids + embedded[b].prompt_token_ids,
            )
            for a, b in pairs
        ]

    def _cross_encode(
        self,
        pairs: list[tuple[str, str]],
        truncate_prompt_tokens: int | None,
        use_tqdm: bool,
        pooling_params: PoolingParams | None,
    ) -> list[ScoringRequestOutput]:
        labels = self.engine.core.model_config.labels
        if len(labels) != 1:
            raise InvalidRequestError(
                f"score needs a cross-encoder (a classifier with one label); this model has "
                f"{len(labels)} labels: use classify"
            )
        tokenizer = self.engine.tokenizer
        inputs: list[PromptType] = [
            {"prompt_token_ids": pair_token_ids(tokenizer, a, b)} for a, b in pairs
        ]
        return [
            ScoringRequestOutput(
                o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids
            )
            for o in self.classify(
                inputs,
                pooling_params=pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
            )
        ]

    def _run(
        self,
        prompts: Sequence[str | list[int] | torch.Tensor],
        given: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        priority: Sequence[int] | None = None,
        lora_request: LoRAArg = None,
        cache_salts: Sequence[str | None] | None = None,
    ) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run every prompt with its params to the end; outputs in the prompts' order."""
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise InvalidRequestError(
                f"got {len(prompts)} prompts but {len(priorities)} priorities"
            )
        loras = _lora_list(lora_request, len(prompts))
        engine = self.engine
        params = [
            engine.tokenize_bad_words(p) if isinstance(p, SamplingParams) else p for p in given
        ]
        # Validate everything first so one bad prompt does not leave others half-submitted.
        encoded = [
            truncate_prompt(_token_ids(engine, p), sp.truncate_prompt_tokens, engine.max_model_len)
            for p, sp in zip(prompts, params, strict=True)
        ]
        for p, token_ids, sp, prio, lora in zip(
            prompts, encoded, params, priorities, loras, strict=True
        ):
            embeds = None
            if isinstance(p, torch.Tensor):
                embeds = truncate_embeds(p, sp, engine.max_model_len)
            engine.core.validate_request(token_ids, sp, prio, lora, embeds)
        ids = [str(next(self._counter)) for _ in prompts]
        salts = [None] * len(prompts) if cache_salts is None else cache_salts
        for req_id, prompt, token_ids, sp, prio, lora, salt in zip(
            ids, prompts, encoded, params, priorities, loras, salts, strict=True
        ):
            engine.add_request(
                req_id,
                prompt,
                sp,
                prompt_token_ids=token_ids,
                priority=prio,
                lora_request=lora,
                cache_salt=salt,
            )
        results: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            try:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        results[out.request_id] = out
                        bar.update(1)
            except BaseException:
                for req_id in ids:
                    engine.abort_request(req_id)
                raise
        return [results[i] for i in ids]


def _token_ids(engine: LLMEngine, prompt: str | list[int] | torch.Tensor) -> list[int]:
    """A prompt's token ids (none for input embeddings)."""
    if isinstance(prompt, torch.Tensor):
        return []
    return engine.encode(prompt) if isinstance(prompt, str) else prompt


def _salt_list(prompts: PromptType | Sequence[PromptType]) -> list[str | None]:
    """Each prompt's ``cache_salt`` (None: none), as ``_prompt_list`` lists the prompts."""
    given: list[Any] = [prompts] if isinstance(prompts, str | dict) else list(prompts)
    return [check_salt(p.get("cache_salt")) if isinstance(p, dict) else None for p in given]


@overload
def _prompt_list(
    prompts: PromptType | Sequence[PromptType], embeds_ok: Literal[False] = False
) -> list[str | list[int]]: ...


@overload
def _prompt_list(
    prompts: PromptType | Sequence[PromptType], embeds_ok: bool
) -> list[str | list[int] | torch.Tensor]: ...


def _prompt_list(
    prompts: PromptType | Sequence[PromptType], embeds_ok: bool = False
) -> list[str | list[int] | torch.Tensor] | list[str | list[int]]:
    """Prompts as text, token ids or (``embeds_ok``: generate) input embeddings, however given
    (one or many; strings, TextPrompt, TokensPrompt or EmbedsPrompt dicts, as vLLM takes
    them)."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    out = [parse_prompt(p) for p in prompts]
    if not embeds_ok and any(isinstance(p, torch.Tensor) for p in out):
        raise InvalidRequestError("prompt_embeds are for generate() only")
    return out


def _lora_list(lora_request: LoRAArg, num_prompts: int) -> list[LoRARequest | None]:
    """One LoRA adapter (or None) per prompt, however given."""
    loras = (
        list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * num_prompts
    )
    if len(loras) != num_prompts:
        raise InvalidRequestError(f"got {num_prompts} prompts but {len(loras)} LoRA requests")
    return loras


def _params_list(given: Any, kind: type[_P], num_prompts: int) -> list[_P]:
    """One params object (for every prompt), or one per prompt, as a list of ``kind``."""
    params = list(given) if isinstance(given, Sequence) else [given] * num_prompts
    for p in params:
        if not isinstance(p, kind):
            raise InvalidRequestError(f"expected {kind.__name__}, got {type(p).__name__}")
    if len(params) != num_prompts:
        raise InvalidRequestError(f"got {num_prompts} prompts but {len(params)} {kind.__name__}")
    return params

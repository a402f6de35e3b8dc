"""The request pipeline behind the completion routes, the Responses API (served as a chat
request, ``responses_api.py``) and vLLM's tokenizer routes.

Model name (404) -> prompt token ids -> length check (400) -> one Generate request per sequence
-> a whole response, or SSE events. ``n`` runs as ``n`` Generate calls; with a ``seed``, call
``i`` gets ``seed + i`` so the choices differ yet the response is reproducible.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from baton import tracing
from baton.v1 import engine_pb2
from baton_engine import beam_search
from baton_engine.beam_search import BeamSearchParams, BeamSearchSequence
from baton_engine.errors import InvalidRequestError
from baton_engine.outputs import Logprob
from baton_engine.pooling_params import cosine_similarity, pair_token_ids, score_pairs
from baton_engine.sampling_params import tokenize_bad_words, truncate_prompt
from baton_gateway import classification, codec, embeddings, responses_api, scoring
from baton_gateway.chat import (
    ChatDefaults,
    message_dict,
    render_chat_prompt,
    tokenize_chat,
    tokenize_text,
)
from baton_gateway.classification import ClassificationChatRequest, ClassificationRequest
from baton_gateway.client import WorkerPool
from baton_gateway.embeddings import (
    EmbeddingChatRequest,
    EmbeddingCompletionRequest,
    EmbeddingRequest,
)
from baton_gateway.errors import GatewayError, bad_request
from baton_gateway.generation import Generation, SequenceDelta, SequenceSpec, TextOptions
from baton_gateway.metrics import GatewayMetrics, RequestRecord
from baton_gateway.protocol import (
    ChatCompletionRequest,
    ChatPrompt,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    random_id,
)
from baton_gateway.reading import ChatReading
from baton_gateway.reasoning import reasoning_use
from baton_gateway.responses import (
    ChoiceBuffer,
    Outputs,
    TokenText,
    TokenTexts,
    chat_logprobs,
    chat_response,
    completion_response,
    token_id_text,
    usage_info,
)
from baton_gateway.responses_api import ResponsesRequest
from baton_gateway.scoring import RerankRequest, ScoreRequest
from baton_gateway.streaming import (
    SSEResponse,
    StreamContext,
    StreamOutcome,
    chat_stream,
    completion_stream,
)
from baton_gateway.tensor_file import RawTensor, read_tensor
from baton_gateway.tools import ReadOut, ToolCallsSoFar, tool_use

logger = logging.getLogger(__name__)

# What the id and truncation helpers read: ``request_id``, ``truncate_prompt_tokens``.
_WithPrompt = (
    ChatCompletionRequest
    | CompletionRequest
    | EmbeddingRequest
    | ClassificationRequest
    | ClassificationChatRequest
    | ScoreRequest
    | RerankRequest
)


def prompt_length(prompt: list[int] | RawTensor) -> int:
    """A prompt's tokens, or its embeddings' rows."""
    return len(prompt) if isinstance(prompt, list) else prompt.shape[0]


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output budget of one sequence: ``max_tokens``, or all the context the prompt leaves.

    Raises a 400 GatewayError (vLLM's wording) for an empty prompt, a prompt that fills the
    context, or prompt + ``max_tokens`` beyond it.
    """
    if num_prompt_tokens == 0:
        raise bad_request("the prompt is empty", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {num_prompt_tokens} input tokens. Please reduce the length of the "
            "input messages.",
            param="messages",
        )
    remaining = max_model_len - num_prompt_tokens
    if max_tokens is None:
        return remaining
    if max_tokens > remaining:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    return max_tokens


@dataclass(frozen=True, slots=True)
class RequestIds:
    """Where a response's id may come from besides the body's ``request_id``."""

    header: str | None = None  # the request's X-Request-Id
    server: str | None = None  # the one --enable-request-id-headers made for the response


class Pipeline:
    """Serves chat and text completions and responses for one model on ``pool``."""

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        metrics: GatewayMetrics,
        tool_parser: str | None = None,
        chat: ChatDefaults | None = None,
        response_role: str = "assistant",
        reasoning_parser: str | None = None,
        generation_defaults: dict[str, Any] | None = None,
        tokens_as_ids: bool = False,
        max_stored_responses: int = 0,
        lora_modules: Mapping[str, str] | None = None,
        labels: tuple[str, ...] = (),
        force_include_usage: bool = False,
        model_aliases: tuple[str, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        trust_request_chat_template: bool = False,
    ) -> None:
        """``tool_parser``: the parser "auto" tool choice uses (None: "auto" is refused);
        ``chat``: how conversations are rendered (the server's chat template, its default
        arguments, the content format, whether tool_choice "none" hides the tools);
        ``response_role``: chat answers' role after a generation prompt (vLLM's
        ``--response-role``);
        ``reasoning_parser``: how chat outputs are split into reasoning and content (None:
        they are not); ``generation_defaults``: the sampling params of requests that leave
        them unset, and a cap on ``max_tokens`` (the model's generation config, as in vLLM);
        ``tokens_as_ids``: logprobs name every token ``"token_id:{id}"`` (vLLM's
        ``--return-tokens-as-token-ids``); ``lora_modules``: the LoRA adapters the workers
        serve (name: path), which requests name as their ``model``; ``max_stored_responses``:
        how many Responses API answers are kept for ``previous_response_id`` and ``GET
        /v1/responses/{id}``; ``labels``: a sequence-classification model's (it serves
        ``/classify``, and ``/score`` and ``/rerank`` as a cross-encoder, not embeddings);
        ``force_include_usage``: streamed completions end with a usage chunk even when the
        request does not ask for one (vLLM's ``--enable-force-include-usage``);
        ``model_aliases``: other names requests may give the model (vLLM's further
        ``--served-model-name`` values); ``eos_token_ids``: the model's (where beam search
        ends a beam); ``trust_request_chat_template``: requests may bring their own chat
        template (vLLM's ``--trust-request-chat-template``; else a 400, as there: a template
        is code the gateway runs)."""
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_aliases = model_aliases
        self.eos_token_ids = eos_token_ids
        self.trust_request_chat_template = trust_request_chat_template
        self.lora_modules = dict(lora_modules or {})
        self.labels = labels
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.tool_parser = tool_parser
        self.chat_defaults = chat if chat is not None else ChatDefaults()
        self.force_include_usage = force_include_usage
        self.response_role = response_role
        self.reasoning_parser = reasoning_parser
        self.defaults = dict(generation_defaults or {})
        self.texts = TokenTexts(tokenizer)
        self.tokens_as_ids = tokens_as_ids
        self.stored_responses = responses_api.ResponseStore(max_stored_responses)
        self._runs: set[asyncio.Task[str]] = set()  # background responses running

    def check_model(self, model: str | None) -> None:
        if model is not None and not self._is_base(model) and model not in self.lora_modules:
            raise GatewayError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
            )

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """Serve a LoRA adapter under ``lora_name`` on every worker from now on."""
        if lora_name in self.lora_modules or self._is_base(lora_name):
            raise bad_request(
                f"The lora adapter '{lora_name}' has already been loaded.", param="lora_name"
            )
        await self.pool.load_lora_adapter(lora_name, lora_path)
        self.lora_modules[lora_name] = lora_path

    async def unload_lora_adapter(self, lora_name: str) -> None:
        """Stop serving a LoRA adapter (requests running with it finish)."""
        if lora_name not in self.lora_modules:
            raise GatewayError(
                HTTPStatus.NOT_FOUND,
                f"The lora adapter '{lora_name}' cannot be found.",
                param="lora_name",
            )
        del self.lora_modules[lora_name]  # (no new request may name it)
        await self.pool.unload_lora_adapter(lora_name)

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model)."""
        return model if model is not None and model in self.lora_modules else None

    def _render_chat(self, request: ChatPrompt) -> str:
        """``request``'s conversation as prompt text, with the server's template defaults; a
        request's own template only when the server trusts them (vLLM's rule)."""
        self._check_template(request)
        return render_chat_prompt(self.tokenizer, request, self.chat_defaults)

    def _tokenize_chat(self, request: ChatPrompt) -> list[int]:
        self._check_template(request)
        return tokenize_chat(self.tokenizer, request, self.chat_defaults)

    def _check_template(self, request: ChatPrompt) -> None:
        given = request.chat_template is not None or (
            (request.chat_template_kwargs or {}).get("chat_template") is not None
        )
        if given and not self.trust_request_chat_template:
            raise bad_request(  # (vLLM's words)
                "Chat template is passed with request, but --trust-request-chat-template is "
                "not set. Refused request with untrusted chat template.",
                param="chat_template",
            )

    def _is_base(self, model: str) -> bool:
        return model == self.model_name or model in self.model_aliases

    def served_name(self, model: str | None) -> str:
        """The ``model`` a response names, as vLLM answers: the adapter's, or the base model's
        name the request gave, else the first."""
        if model is not None and self._is_base(model):
            return model
        return self.lora_of(model) or self.model_name

    def _specs(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        req_id: str,
        prompts: Sequence[list[int] | RawTensor],
        max_tokens: int | None,
        reasoning_end: str | None = None,
    ) -> list[SequenceSpec]:
        """Each prompt's ``n`` sequences (a prompt: its token ids, or its embeddings)."""
        self._check_vocabulary(list(request.token_biases), "logit_bias")
        self._check_vocabulary(request.allowed_token_ids or [], "allowed_token_ids")
        bad_words = None
        if request.bad_words:
            try:
                bad_words = tokenize_bad_words(request.bad_words, self.tokenizer)
            except InvalidRequestError as e:
                raise bad_request(str(e), param="bad_words") from e
        specs = []
        for p, prompt in enumerate(prompts):
            ids, embeds = (prompt, None) if isinstance(prompt, list) else ([], prompt)
            budget = check_length(prompt_length(prompt), max_tokens, self.max_model_len)
            budget = min(budget, self.defaults.get("max_tokens", budget))
            if request.min_tokens > budget:
                raise bad_request(
                    f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({budget})",
                    param="min_tokens",
                )
            for i in range(request.n):
                index = p * request.n + i
                seed = None if request.seed is None else request.seed + i
                sampling = codec.sampling_params(
                    request, budget, seed, self.defaults, reasoning_end, bad_words
                )
                gen_request = codec.generate_request(
                    f"{req_id}-{index}",
                    ids,
                    sampling,
                    request.priority,
                    self.lora_of(request.model),
                    request.cache_salt,
                    embeds,
                )
                specs.append(SequenceSpec(index, ids, gen_request))
        return specs

    def _generation(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        specs: list[SequenceSpec],
        record: RequestRecord,
    ) -> Generation:
        options = TextOptions(
            stop=tuple(request.stop_strings),
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        parent = tracing.context_with(record.span) if record.span is not None else None
        return Generation(self.pool, self.tokenizer, specs, options, parent)

    def _request_ids(self, prefix: str, request: _WithPrompt, named: RequestIds) -> tuple[str, str]:
        """The response's id and the workers' id base: ``{prefix}-{X-Request-Id}``, else
        ``{prefix}-{request_id}`` (vLLM's), else the one the server made, else random. A
        client's id need not be unique, so the workers' ids add a random part to it."""
        separator = "_" if prefix == "resp" else "-"  # (as OpenAI's ids are)
        given = named.header or request.request_id or named.server
        if not given:
            req_id = random_id(prefix, separator)
            return req_id, req_id
        req_id = f"{prefix}{separator}{given}"
        return req_id, random_id(req_id)

    def _truncated(self, ids: list[int], request: _WithPrompt) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: the context's worth)."""
        try:
            return truncate_prompt(ids, request.truncate_prompt_tokens, self.max_model_len)
        except InvalidRequestError as e:
            raise bad_request(str(e), param="truncate_prompt_tokens") from e

    def _chat_specs(
        self, request: ChatCompletionRequest, prefix: str, named: RequestIds
    ) -> tuple[str, list[SequenceSpec], int, ChatReading | None]:
        """A chat request's response id, sequences, prompt length, and how its choices are
        read (None: plain content)."""
        try:
            tools = tool_use(request, self.tool_parser)
        except ValueError as e:
            raise bad_request(str(e), param="tool_choice") from e
        if tools is not None and tools.keeps_special_tokens:
            request.skip_special_tokens = False  # (as vLLM: the calls' token must show)
        text = self._render_chat(request)
        prompt = tokenize_text(self.tokenizer, text, request.add_special_tokens)
        prompt = self._truncated(prompt, request)
        reasoning = reasoning_use(
            self.reasoning_parser,
            text,
            include=request.include_reasoning,
            constrained=request.structured is not None,
        )
        if reasoning is not None and reasoning.form.special:
            request.skip_special_tokens = False  # (the tags are special tokens)
        reading = ChatReading(tools, reasoning) if tools or reasoning else None
        req_id, worker_id = self._request_ids(prefix, request, named)
        specs = self._specs(
            request,
            worker_id,
            [prompt],
            request.requested_max_tokens,
            reasoning.grammar_after if reasoning is not None else None,
        )
        return req_id, specs, len(prompt), reading

    async def chat(
        self, request: ChatCompletionRequest, named: RequestIds = RequestIds()
    ) -> Response:
        self.check_model(request.model)
        record = self.metrics.start("chat")
        try:
            req_id, specs, num_prompt_tokens, reading = self._chat_specs(request, "chatcmpl", named)
            role = request.response_role(self.response_role)
            echo: dict[int, str] = {}
            last = request.messages[-1]
            if request.echo and last.role == role:
                text = message_dict(last)["content"] or ""
                echo = {s.index: text for s in specs} if text else {}
            return await self._respond(
                request, req_id, specs, num_prompt_tokens, echo, record, reading, role
            )
        except BaseException as e:
            self._fail(record, e)
            raise

    async def responses(
        self, request: ResponsesRequest, named: RequestIds = RequestIds()
    ) -> Response:
        """OpenAI's Responses API, served as a chat request (``responses_api.py``)."""
        self.check_model(request.model)
        if request.background and self.stored_responses.capacity <= 0:
            raise bad_request(
                "Background responses are stored, and --max-stored-responses is 0.",
                param="background",
            )
        record = self.metrics.start("responses")
        try:
            history: list[dict[str, Any]] = []
            if request.previous_response_id is not None:
                previous = self._stored(request.previous_response_id, "previous_response_id")
                if previous.running:
                    raise bad_request(
                        f"Response with id '{request.previous_response_id}' has not finished.",
                        param="previous_response_id",
                    )
                history = previous.conversation
            try:
                chat = ChatCompletionRequest.model_validate(
                    responses_api.chat_request(request, history)
                )
            except ValidationError as e:
                raise RequestValidationError(e.errors()) from e
            resp_id, specs, num_prompt_tokens, reading = self._chat_specs(chat, "resp", named)
            generation = self._generation(chat, specs, record)
            texts = self.texts if chat.num_logprobs is not None else None
            start = responses_api.response_object(request, resp_id, self.served_name(request.model))
            run = responses_api.BackgroundRun(request.stream) if request.background else None

            def store(response: responses_api.ResponseObject) -> responses_api.ResponseObject:
                if request.store:
                    output = response.output
                    conversation = responses_api.conversation_after(history, request, output)
                    stored = responses_api.StoredResponse(response, conversation, run)
                    self.stored_responses.put(stored)
                return response

            def finish(
                output: list[responses_api.OutputItem], reason: str | None
            ) -> responses_api.ResponseObject:
                response = responses_api.finished(
                    start,
                    output,
                    usage_info(generation, num_prompt_tokens),
                    reason,
                    lambda text: len(self.tokenizer.encode(text, add_special_tokens=False)),
                )
                return store(response)

            def record_finish(status: str) -> None:
                self.metrics.finish(
                    record,
                    status,
                    first_token_time=generation.first_token_time,
                    num_prompt_tokens=num_prompt_tokens,
                    num_generation_tokens=sum(generation.num_output_tokens.values()),
                )

            reader = reading.new_reader() if reading is not None else None
            if run is not None:
                queued = store(start.model_copy(update={"status": "queued"}))
                events = responses_api.ResponseEvents(queued, reader, texts)
                work = self._background(start, generation, events, run, finish, store)
                run.task = asyncio.create_task(work)
                self._runs.add(run.task)

                def ended(task: asyncio.Task[str]) -> None:
                    self._runs.discard(task)
                    if task.cancelled():  # (before it started)
                        store(responses_api.stopped(start, "cancelled", []))
                        run.finish()
                    record_finish("cancelled" if task.cancelled() else task.result())

                run.task.add_done_callback(ended)
                if run.events is not None:
                    return SSEResponse(run.follow())
                return Response(queued.model_dump_json(), media_type="application/json")
            if request.stream:
                events = responses_api.ResponseEvents(start, reader, texts)
                return await self._stream_response(generation, events, finish, record_finish)
            choice = ChoiceBuffer(0, specs[0].prompt_token_ids)
            async with aclosing(generation.stream()) as deltas:
                async for delta in deltas:
                    choice.add(delta)
            read = ReadOut(choice.text)
            if reader is not None:
                read = reader.feed(choice.text, final=True)
            calls = ToolCallsSoFar()
            calls.add(read.tool_calls)
            logprobs = []
            if texts is not None:
                logprobs = chat_logprobs(texts, choice.logprobs).content or []
            output = responses_api.output_items(
                read.reasoning,
                read.content,
                calls.as_list(),
                logprobs,
                "incomplete" if choice.finish_reason == "length" else "completed",
            )
            body = finish(output, choice.finish_reason)
            record_finish("ok")
            return Response(body.model_dump_json(), media_type="application/json")
        except BaseException as e:
            self._fail(record, e)
            raise

    async def _stream_response(
        self,
        generation: Generation,
        events: responses_api.ResponseEvents,
        finish: responses_api.Finish,
        record_finish: Callable[[str], None],
    ) -> Response:
        """A streamed Responses API answer (its first delta awaited first, as for chat, so
        that a refusal is an HTTP error)."""
        deltas = generation.stream()
        try:
            first = await anext(deltas)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise
        outcome = StreamOutcome()

        async def on_close() -> None:
            await deltas.aclose()
            record_finish(outcome.status)

        stream = responses_api.response_stream(events, first, deltas, finish, outcome)
        return SSEResponse(stream, on_close)

    async def _background(
        self,
        start: responses_api.ResponseObject,
        generation: Generation,
        events: responses_api.ResponseEvents,
        run: responses_api.BackgroundRun,
        finish: responses_api.Finish,
        store: Callable[[responses_api.ResponseObject], responses_api.ResponseObject],
    ) -> str:
        """A background response's run, to its end (stored as it goes); how it ended, for
        metrics ("ok", "error", "cancelled" or "500")."""
        store(start)  # (in progress)
        outcome = StreamOutcome()
        deltas = generation.stream()
        stream = responses_api.response_stream(events, None, deltas, finish, outcome)
        try:
            async for event in stream:
                run.emit(event)
        except asyncio.CancelledError:  # POST /v1/responses/{id}/cancel, or shutting down
            if outcome.status == "cancelled":  # (not ended yet)
                if events.output:
                    events.close()  # (its items, with their text so far; no events sent)
                store(responses_api.stopped(start, "cancelled", events.output))
        except Exception as e:  # (a bug: the response says so; the gateway goes on)
            logger.exception("background response %s failed", start.id)
            outcome.status = "500"
            error = GatewayError(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(e).__name__}: {e}")
            store(responses_api.stopped(start, "failed", events.output, error))
        finally:
            await stream.aclose()
            await deltas.aclose()
            run.finish()
        if outcome.error is not None:
            store(responses_api.stopped(start, "failed", events.output, outcome.error))
        return outcome.status

    async def cancel_response(self, response_id: str) -> responses_api.ResponseObject:
        """``POST /v1/responses/{id}/cancel``: a background response stops where it is (one
        that has ended is answered as it is)."""
        stored = self._stored(response_id)
        if stored.run is None:
            raise bad_request("Cannot cancel a synchronous response.")
        await self._stop(stored.run)
        return self._stored(response_id).response

    async def _stop(self, run: responses_api.BackgroundRun) -> None:
        task = run.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait({task})  # (its cancellation, not this request's, is swallowed)

    async def close(self) -> None:
        """Stop every background response (the gateway is shutting down)."""
        for task in list(self._runs):
            task.cancel()
        await asyncio.gather(*self._runs, return_exceptions=True)

    def response_events(
        self, response_id: str, starting_after: int | None
    ) -> AsyncGenerator[str, None]:
        """``GET /v1/responses/{id}?stream=true``: a background response's stream again, from
        after ``starting_after`` (else from its start)."""
        stored = self._stored(response_id)
        if stored.run is None or stored.run.events is None:
            raise bad_request(
                "Only a response created with background=true and stream=true can be streamed.",
                param="stream",
            )
        return stored.run.follow(-1 if starting_after is None else starting_after)

    def _stored(self, response_id: str, param: str | None = None) -> responses_api.StoredResponse:
        """The stored response ``response_id``, or a 404 (vLLM's wording)."""
        stored = self.stored_responses.get(response_id)
        if stored is None:
            raise GatewayError(
                HTTPStatus.NOT_FOUND, f"Response with id '{response_id}' not found.", param
            )
        return stored

    def stored_response(self, response_id: str) -> responses_api.ResponseObject:
        """``GET /v1/responses/{id}``."""
        return self._stored(response_id).response

    async def delete_response(self, response_id: str) -> responses_api.DeletedResponse:
        """``DELETE /v1/responses/{id}`` (a background response still running is stopped)."""
        stored = self._stored(response_id)
        if stored.run is not None:
            await self._stop(stored.run)
        self.stored_responses.delete(response_id)
        return responses_api.DeletedResponse(id=response_id)

    async def completion(
        self, request: CompletionRequest, named: RequestIds = RequestIds()
    ) -> Response:
        self.check_model(request.model)
        record = self.metrics.start("completion")
        try:
            prompts: list[list[int] | RawTensor] = [
                *(self._prompt_embeds(e, request) for e in request.embeds_list),
                *self._completion_prompts(request),
            ]
            echo: dict[int, str] = {}
            if request.echo:  # (not with prompt embeds: all prompts are token ids)
                for p, ids in enumerate(prompts):
                    raw = request.prompt if isinstance(request.prompt, str) else None
                    if isinstance(request.prompt, list) and isinstance(request.prompt[p], str):
                        raw = str(request.prompt[p])
                    if raw is None or request.truncate_prompt_tokens is not None:
                        assert isinstance(ids, list)
                        raw = self.tokenizer.decode(ids)  # (the prompt as the model saw it)
                    echo.update({p * request.n + i: raw for i in range(request.n)})
            req_id, worker_id = self._request_ids("cmpl", request, named)
            specs = self._specs(request, worker_id, prompts, request.max_tokens)
            num_prompt_tokens = sum(map(prompt_length, prompts))
            return await self._respond(request, req_id, specs, num_prompt_tokens, echo, record)
        except BaseException as e:
            self._fail(record, e)
            raise

    def _prompt_embeds(self, encoded: str, request: CompletionRequest) -> RawTensor:
        """One of vLLM's ``prompt_embeds`` (a base64 ``torch.save`` tensor, [length, hidden
        size] or [1, length, hidden size]), truncated as asked. The workers check the hidden
        size."""
        try:
            tensor = read_tensor(base64.b64decode(encoded, validate=True))
        except binascii.Error as e:
            raise bad_request(
                "prompt_embeds must be base64-encoded torch.save tensors (not base64)",
                param="prompt_embeds",
            ) from e
        except ValueError as e:
            raise bad_request(f"prompt_embeds: {e}", param="prompt_embeds") from e
        if len(tensor.shape) == 3 and tensor.shape[0] == 1:
            tensor = replace(tensor, shape=tensor.shape[1:])
        if len(tensor.shape) != 2 or 0 in tensor.shape:
            raise bad_request(
                "prompt_embeds must have the shape [prompt length, hidden size], got "
                f"{list(tensor.shape)}",
                param="prompt_embeds",
            )
        rows, cols = tensor.shape
        kept = self._truncated(list(range(rows)), request)  # (the rows truncation keeps)
        if len(kept) < rows:
            row_bytes = len(tensor.data) // rows
            tensor = replace(
                tensor, shape=(len(kept), cols), data=tensor.data[kept[0] * row_bytes :]
            )
        return tensor

    def _completion_prompts(
        self, request: CompletionRequest | EmbeddingCompletionRequest | ClassificationRequest
    ) -> list[list[int]]:
        """The token ids of each prompt (``input``, for embeddings and classification),
        truncated as asked."""
        prompt = request.prompt if isinstance(request, CompletionRequest) else request.input
        if prompt is None:  # (a completion of prompt embeddings alone)
            return []
        if isinstance(prompt, str):
            prompts = [tokenize_text(self.tokenizer, prompt, request.add_special_tokens)]
        elif isinstance(prompt[0], str):
            prompts = [
                tokenize_text(self.tokenizer, str(p), request.add_special_tokens) for p in prompt
            ]
        elif isinstance(prompt[0], int):
            prompts = [[int(t) for t in prompt]]
        else:
            prompts = [list(p) for p in prompt]
        for ids in prompts:
            self._check_vocabulary(ids, "prompt")
        return [self._truncated(ids, request) for ids in prompts]

    def _pooling_prompts(
        self,
        request: EmbeddingRequest | ClassificationRequest | ClassificationChatRequest,
    ) -> list[list[int]]:
        """An embedding or classification request's prompts: its conversation, rendered with
        the chat template, or its inputs; truncated as asked."""
        if isinstance(request, EmbeddingChatRequest | ClassificationChatRequest):
            return [self._truncated(self._tokenize_chat(request), request)]
        return self._completion_prompts(request)

    async def embeddings(
        self, request: EmbeddingRequest, named: RequestIds = RequestIds()
    ) -> Response:
        """``/v1/embeddings``: every input's ids to one decode worker's ``Embed``."""
        self.check_model(request.model)
        if self.labels:
            raise bad_request(
                "this is a sequence-classification model: it does not embed (use /classify, "
                "/score or /rerank)"
            )
        return await self._pooled(request, named, "embeddings", "embd", embeddings.response)

    async def pooling(
        self, request: EmbeddingRequest, named: RequestIds = RequestIds()
    ) -> Response:
        """vLLM's ``/pooling``: the embeddings' request, answered with each input's pooler
        output as it is: an embedding model's embedding, a classifier's labels'
        probabilities."""
        self.check_model(request.model)
        return await self._pooled(request, named, "pooling", "pool", embeddings.pooling_response)

    async def _pooled(
        self,
        request: EmbeddingRequest,
        named: RequestIds,
        endpoint: str,
        id_prefix: str,
        respond: Callable[[str, str, list[codec.Embedded], str], Any],
    ) -> Response:
        """Every input's ids to one decode worker's ``Embed``; ``respond`` builds the body."""
        record = self.metrics.start(endpoint)
        try:
            prompts = self._pooling_prompts(request)
            req_id, worker_id = self._request_ids(id_prefix, request, named)
            pb = codec.embed_request(
                worker_id,
                prompts,
                request.priority,
                request.dimensions,
                request.normalize,
                self.lora_of(request.model),
            )
            pooled = await self._embed(pb, record)
            name = self.served_name(request.model)
            body = respond(req_id, name, pooled, request.encoding_format)
            self.metrics.finish(record, "ok", num_prompt_tokens=body.usage.prompt_tokens)
            return Response(body.model_dump_json(), media_type="application/json")
        except BaseException as e:
            self._fail(record, e)
            raise

    async def classify(
        self,
        request: ClassificationRequest | ClassificationChatRequest,
        named: RequestIds = RequestIds(),
    ) -> Response:
        """vLLM's ``/classify`` (``classification.py``): every input's ids to one decode
        worker's ``Embed``, which a classifier answers with its labels' probabilities."""
        self.check_model(request.model)
        if not self.labels:
            raise bad_request(
                "this model does not classify: /classify needs a sequence-classification model "
                "(an architecture *ForSequenceClassification)"
            )
        record = self.metrics.start("classify")
        try:
            prompts = self._pooling_prompts(request)
            req_id, worker_id = self._request_ids("classify", request, named)
            pb = codec.embed_request(
                worker_id,
                prompts,
                request.priority,
                lora_name=self.lora_of(request.model),
                activation=request.activation,
            )
            classified = await self._embed(pb, record)
            name = self.served_name(request.model)
            body = classification.response(req_id, name, self.labels, classified)
            self.metrics.finish(record, "ok", num_prompt_tokens=body.usage.prompt_tokens)
            return Response(body.model_dump_json(), media_type="application/json")
        except BaseException as e:
            self._fail(record, e)
            raise

    async def score(
        self, request: ScoreRequest | RerankRequest, named: RequestIds = RequestIds()
    ) -> Response:
        """vLLM's ``/score`` and ``/rerank`` (``scoring.py``): as embedding models answer them,
        each pair's cosine similarity, every distinct text embedded once, in one call; a
        cross-encoder (a classifier with one label) reads each pair as one input instead and
        scores it with its head's sigmoid."""
        self.check_model(request.model)
        rerank = isinstance(request, RerankRequest)
        kind = "rerank" if rerank else "score"
        if self.labels and len(self.labels) != 1:
            raise bad_request(
                f"/{kind} needs an embedding model or a cross-encoder (a classifier with one "
                f"label); this model has {len(self.labels)} labels: use /classify"
            )
        record = self.metrics.start(kind)
        try:
            try:
                if isinstance(request, RerankRequest):
                    pairs = score_pairs(request.query, request.documents)
                else:
                    pairs = score_pairs(request.text_1, request.text_2)
            except InvalidRequestError as e:
                raise bad_request(str(e), param="documents" if rerank else "text_2") from e
            req_id, worker_id = self._request_ids(kind, request, named)
            lora_name = self.lora_of(request.model)
            name = self.served_name(request.model)
            if self.labels:  # a cross-encoder
                prompts = [
                    self._truncated(pair_token_ids(self.tokenizer, a, b), request) for a, b in pairs
                ]
                pb = codec.embed_request(worker_id, prompts, request.priority, lora_name=lora_name)
                scored = await self._embed(pb, record)
                scores = [s.values[0] for s in scored]
                num_tokens = sum(s.num_prompt_tokens for s in scored)
            else:
                texts = list(dict.fromkeys(t for pair in pairs for t in pair))
                prompts = [
                    self._truncated(tokenize_text(self.tokenizer, t, True), request) for t in texts
                ]
                pb = codec.embed_request(worker_id, prompts, request.priority, lora_name=lora_name)
                embedded = dict(zip(texts, await self._embed(pb, record), strict=True))
                scores = [
                    cosine_similarity(embedded[a].values, embedded[b].values) for a, b in pairs
                ]
                num_tokens = sum(
                    embedded[a].num_prompt_tokens + embedded[b].num_prompt_tokens for a, b in pairs
                )
            body: scoring.ScoreResponse | scoring.RerankResponse
            if isinstance(request, RerankRequest):
                body = scoring.rerank_response(req_id, name, request, scores, num_tokens)
            else:
                body = scoring.score_response(req_id, name, scores, num_tokens)
            self.metrics.finish(record, "ok", num_prompt_tokens=num_tokens)
            return Response(body.model_dump_json(), media_type="application/json")
        except BaseException as e:
            self._fail(record, e)
            raise

    async def _embed(
        self, request: engine_pb2.EmbedRequest, record: RequestRecord
    ) -> list[codec.Embedded]:
        """Each input's embedding, once every input is checked: none empty, none longer than
        the context (vLLM's 400)."""
        for prompt in request.inputs:
            n = len(prompt.token_ids)
            if n == 0:
                raise bad_request("the prompt is empty", param="input")
            if n > self.max_model_len:
                raise bad_request(
                    f"This model's maximum context length is {self.max_model_len} tokens. "
                    f"However, you requested {n} tokens in the input for embedding "
                    "generation. Please reduce the length of the input.",
                    param="input",
                )
        parent = tracing.context_with(record.span) if record.span is not None else None
        return await self.pool.embed(request, parent)

    def _check_vocabulary(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            message = f"token id {bad} is out of vocabulary (size {self.vocab_size})"
            raise bad_request(message, param)

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """``/tokenize``: the token ids a completion or chat request with these fields would
        get as its prompt (the same template, special tokens and server ``--chat-template``)."""
        self.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            ids = self._tokenize_chat(request)
        else:
            ids = tokenize_text(self.tokenizer, request.prompt, request.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """``/detokenize``: the text of token ids, special tokens included (as in vLLM)."""
        self.check_model(request.model)
        self._check_vocabulary(request.tokens, "tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))

    def _fail(self, record: RequestRecord, error: BaseException) -> None:
        if isinstance(error, GatewayError):
            self.metrics.finish(record, str(error.status))
        elif isinstance(error, asyncio.CancelledError):
            self.metrics.finish(record, "cancelled")
        else:
            self.metrics.finish(record, "500")

    async def _respond(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        req_id: str,
        specs: list[SequenceSpec],
        num_prompt_tokens: int,
        echo: dict[int, str],
        record: RequestRecord,
        reading: ChatReading | None = None,
        role: str = "assistant",
    ) -> Response:
        """A whole response or its stream; ``echo`` maps a choice to the text it starts with
        (a completion's prompt, a chat answer's continued message), ``role`` is a chat
        answer's."""
        generation = self._generation(request, specs, record)
        num_logprobs = request.num_logprobs
        texts: TokenText | None = None
        if num_logprobs is not None:
            as_ids = request.return_tokens_as_token_ids or self.tokens_as_ids
            texts = token_id_text if as_ids else self.texts
        outputs = Outputs(
            texts=texts,
            num_logprobs=num_logprobs or 0,
            prompt_logprobs=request.prompt_logprobs,
            token_ids=request.return_token_ids,
        )
        created = int(time.time())
        is_chat = isinstance(request, ChatCompletionRequest)
        if request.stream:
            return await self._stream(
                request,
                req_id,
                created,
                generation,
                num_prompt_tokens,
                echo,
                record,
                outputs,
                reading,
                role,
            )
        if request.use_beam_search:
            choices = await self._beam_search(request, specs, echo)
            generated = sum(len(c.token_ids) for c in choices.values())
            usage = UsageInfo(
                prompt_tokens=num_prompt_tokens,
                completion_tokens=generated,
                total_tokens=num_prompt_tokens + generated,
            )
        else:
            choices = {
                s.index: ChoiceBuffer(s.index, s.prompt_token_ids, echo.get(s.index)) for s in specs
            }
            async with aclosing(generation.stream()) as deltas:
                async for delta in deltas:
                    choices[delta.index].add(delta)
            usage = usage_info(generation, num_prompt_tokens)
        common: dict[str, Any] = dict(
            request_id=req_id,
            created=created,
            model=self.served_name(request.model),
            choices=choices.values(),
            usage=usage,
            outputs=outputs,
            names=self.texts,
        )
        body = (
            chat_response(**common, reading=reading, role=role)
            if is_chat
            else completion_response(**common)
        )
        self.metrics.finish(
            record,
            "ok",
            first_token_time=generation.first_token_time,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=usage.completion_tokens,
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _beam_search(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        specs: list[SequenceSpec],
        echo: dict[int, str],
    ) -> dict[int, ChoiceBuffer]:
        """vLLM's ``use_beam_search`` (``baton_engine.beam_search``): per prompt, ``n`` beams
        grown one token per step (every live beam's sequence a one-token request with the top
        ``2n`` logprobs, all at once); its ``n`` best become its choices, best first."""
        width = request.n
        params = BeamSearchParams(
            beam_width=width,
            max_tokens=specs[0].request.sampling.max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature or 0.0,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
        eos = frozenset(self.eos_token_ids)
        firsts = [s for s in specs if s.index % width == 0]  # one per prompt
        live = [[BeamSearchSequence(tokens=list(s.prompt_token_ids))] for s in firsts]
        completed: list[list[BeamSearchSequence]] = [[] for _ in firsts]
        for step in range(max(s.request.sampling.max_tokens for s in firsts)):
            for p, spec in enumerate(firsts):  # (each prompt has its own budget)
                if step >= spec.request.sampling.max_tokens:
                    completed[p] += live[p]
                    live[p] = []
            batch = [(p, beam) for p, beams in enumerate(live) for beam in beams]
            if not batch:
                break
            asks = [
                self._next_logprobs(firsts[p], beam, 2 * width, f"{step}-{j}")
                for j, (p, beam) in enumerate(batch)
            ]
            tops = await asyncio.gather(*asks)
            grouped: list[list[Any]] = [[] for _ in firsts]
            for (p, _), top in zip(batch, tops, strict=True):
                grouped[p].append(top)
            for p in range(len(firsts)):
                live[p] = beam_search.expand(live[p], grouped[p], params, eos, completed[p])
        choices: dict[int, ChoiceBuffer] = {}
        for p, spec in enumerate(firsts):
            ranked = beam_search.best(live[p], completed[p], params, eos)
            for rank, beam in enumerate(ranked):
                index = spec.index + rank
                generated = beam.tokens[len(spec.prompt_token_ids) :]
                shown = generated
                if beam.finish_reason == "stop" and not request.include_stop_str_in_output:
                    shown = generated[:-1]
                text = self.tokenizer.decode(shown, skip_special_tokens=request.skip_special_tokens)
                choice = ChoiceBuffer(index, spec.prompt_token_ids, echo.get(index))
                choice.parts, choice.token_ids = [text], generated
                choice.finish_reason = beam.finish_reason
                choices[index] = choice
        return choices

    async def _next_logprobs(
        self, spec: SequenceSpec, beam: BeamSearchSequence, num: int, suffix: str
    ) -> dict[int, Logprob] | None:
        """The top ``num`` logprobs of ``beam``'s next token (and the sampled one's), from a
        one-token request on ``beam``'s sequence."""
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(spec.request)
        request.req_id = f"{spec.request.req_id}-beam-{suffix}"
        del request.prompt_token_ids[:]
        request.prompt_token_ids.extend(beam.tokens)
        request.sampling.max_tokens = 1
        request.sampling.min_tokens = 0
        request.sampling.logprobs = num
        request.sampling.ignore_eos = True
        async with aclosing(self.pool.generate(request)) as chunks:
            async for chunk in chunks:
                if chunk.logprobs:
                    lp = chunk.logprobs[0]
                    top = {token: Logprob(value) for token, value in lp.top}
                    top.setdefault(lp.token_id, Logprob(lp.logprob))
                    return top
        return None

    async def _stream(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        req_id: str,
        created: int,
        generation: Generation,
        num_prompt_tokens: int,
        echo: dict[int, str],
        record: RequestRecord,
        outputs: Outputs,
        reading: ChatReading | None,
        role: str,
    ) -> Response:
        deltas = generation.stream()
        # Wait for the first delta before answering, so that a worker refusing the request
        # (at capacity, invalid) is a proper HTTP error, not an error event in a 200 stream.
        first: SequenceDelta | None
        try:
            first = await anext(deltas)
        except StopAsyncIteration:
            first = None
        except BaseException:
            await deltas.aclose()
            raise
        ctx = StreamContext(
            request_id=req_id,
            created=created,
            model=self.served_name(request.model),
            num_choices=len(generation.num_output_tokens),
            num_prompt_tokens=num_prompt_tokens,
            include_usage=request.include_usage or self.force_include_usage,
            continuous_usage=request.continuous_usage,
            outputs=outputs,
        )
        outcome = StreamOutcome()
        events: AsyncGenerator[str, None]
        if isinstance(request, ChatCompletionRequest):
            events = chat_stream(ctx, generation, first, deltas, outcome, reading, role, echo)
        else:
            events = completion_stream(ctx, generation, echo, first, deltas, outcome)

        async def on_close() -> None:
            await deltas.aclose()
            self.metrics.finish(
                record,
                outcome.status,
                first_token_time=generation.first_token_time,
                num_prompt_tokens=num_prompt_tokens,
                num_generation_tokens=sum(generation.num_output_tokens.values()),
            )

        return SSEResponse(events, on_close)

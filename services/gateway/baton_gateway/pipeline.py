"""The request pipeline behind the two completion routes (and vLLM's tokenizer routes).

Model name (404) -> prompt token ids -> length check (400) -> one Generate request per sequence
-> a whole response, or SSE events. ``n`` runs as ``n`` Generate calls; with a ``seed``, call
``i`` gets ``seed + i`` so the choices differ yet the response is reproducible.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

from fastapi.responses import Response

from baton import tracing
from baton_gateway import codec
from baton_gateway.chat import render_chat_prompt, tokenize_chat, tokenize_text
from baton_gateway.client import WorkerPool
from baton_gateway.errors import GatewayError, bad_request
from baton_gateway.generation import Generation, SequenceDelta, SequenceSpec, TextOptions
from baton_gateway.metrics import GatewayMetrics, RequestRecord
from baton_gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeRequest,
    TokenizeResponse,
    random_id,
)
from baton_gateway.reading import ChatReading
from baton_gateway.reasoning import reasoning_use
from baton_gateway.responses import (
    ChoiceBuffer,
    TokenTexts,
    chat_response,
    completion_response,
    usage_info,
)
from baton_gateway.streaming import (
    SSEResponse,
    StreamContext,
    StreamOutcome,
    chat_stream,
    completion_stream,
)
from baton_gateway.tools import tool_use


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


class Pipeline:
    """Serves chat and text completions for one model on ``pool``."""

    def __init__(
        self,
        pool: WorkerPool,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        vocab_size: int,
        metrics: GatewayMetrics,
        tool_parser: str | None = None,
        chat_template: str | None = None,
        reasoning_parser: str | None = None,
        generation_defaults: dict[str, Any] | None = None,
    ) -> None:
        """``tool_parser``: the parser "auto" tool choice uses (None: "auto" is refused);
        ``chat_template``: the template chat requests use instead of the model's;
        ``reasoning_parser``: how chat outputs are split into reasoning and content (None:
        they are not); ``generation_defaults``: the sampling params of requests that leave
        them unset, and a cap on ``max_tokens`` (the model's generation config, as in vLLM)."""
        self.pool = pool
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.tool_parser = tool_parser
        self.chat_template = chat_template
        self.reasoning_parser = reasoning_parser
        self.defaults = dict(generation_defaults or {})
        self.texts = TokenTexts(tokenizer)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise GatewayError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
            )

    def _specs(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        req_id: str,
        prompts: list[list[int]],
        max_tokens: int | None,
        reasoning_end: str | None = None,
    ) -> list[SequenceSpec]:
        self._check_vocabulary(list(request.token_biases), "logit_bias")
        self._check_vocabulary(request.allowed_token_ids or [], "allowed_token_ids")
        specs = []
        for p, ids in enumerate(prompts):
            budget = check_length(len(ids), max_tokens, self.max_model_len)
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
                    request, budget, seed, self.defaults, reasoning_end
                )
                gen_request = codec.generate_request(f"{req_id}-{index}", ids, sampling)
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

    async def chat(self, request: ChatCompletionRequest) -> Response:
        self.check_model(request.model)
        record = self.metrics.start("chat")
        try:
            try:
                tools = tool_use(request, self.tool_parser)
            except ValueError as e:
                raise bad_request(str(e), param="tool_choice") from e
            text = render_chat_prompt(self.tokenizer, request, self.chat_template)
            prompt = tokenize_text(self.tokenizer, text, request.add_special_tokens)
            reasoning = reasoning_use(
                self.reasoning_parser,
                text,
                include=request.include_reasoning,
                constrained=request.structured is not None,
            )
            reading = ChatReading(tools, reasoning) if tools or reasoning else None
            req_id = random_id("chatcmpl")
            specs = self._specs(
                request,
                req_id,
                [prompt],
                request.requested_max_tokens,
                reasoning.grammar_after if reasoning is not None else None,
            )
            return await self._respond(request, req_id, specs, len(prompt), {}, record, reading)
        except BaseException as e:
            self._fail(record, e)
            raise

    async def completion(self, request: CompletionRequest) -> Response:
        self.check_model(request.model)
        record = self.metrics.start("completion")
        try:
            prompts = self._completion_prompts(request)
            echo: dict[int, str] = {}
            if request.echo:
                for p, ids in enumerate(prompts):
                    raw = request.prompt if isinstance(request.prompt, str) else None
                    if isinstance(request.prompt, list) and isinstance(request.prompt[p], str):
                        raw = str(request.prompt[p])
                    text = raw if raw is not None else self.tokenizer.decode(ids)
                    echo.update({p * request.n + i: text for i in range(request.n)})
            req_id = random_id("cmpl")
            specs = self._specs(request, req_id, prompts, request.max_tokens)
            num_prompt_tokens = sum(len(ids) for ids in prompts)
            return await self._respond(request, req_id, specs, num_prompt_tokens, echo, record)
        except BaseException as e:
            self._fail(record, e)
            raise

    def _completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        prompt = request.prompt
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
        return prompts

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
            ids = tokenize_chat(self.tokenizer, request, self.chat_template)
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
    ) -> Response:
        generation = self._generation(request, specs, record)
        texts = self.texts if request.num_logprobs is not None else None
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
                texts,
                reading,
            )
        choices = {
            s.index: ChoiceBuffer(
                s.index,
                prefix=echo.get(s.index, ""),
                prompt_token_ids=s.prompt_token_ids if s.index in echo else [],
            )
            for s in specs
        }
        async with aclosing(generation.stream()) as deltas:
            async for delta in deltas:
                choices[delta.index].add(delta)
        usage = usage_info(generation, num_prompt_tokens)
        common: dict[str, Any] = dict(
            request_id=req_id,
            created=created,
            model=self.model_name,
            choices=choices.values(),
            usage=usage,
            texts=texts,
        )
        body = (
            chat_response(**common, reading=reading) if is_chat else completion_response(**common)
        )
        self.metrics.finish(
            record,
            "ok",
            first_token_time=generation.first_token_time,
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=usage.completion_tokens,
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _stream(
        self,
        request: ChatCompletionRequest | CompletionRequest,
        req_id: str,
        created: int,
        generation: Generation,
        num_prompt_tokens: int,
        echo: dict[int, str],
        record: RequestRecord,
        texts: TokenTexts | None,
        reading: ChatReading | None,
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
            model=self.model_name,
            num_choices=len(generation.num_output_tokens),
            num_prompt_tokens=num_prompt_tokens,
            include_usage=request.include_usage,
            continuous_usage=request.continuous_usage,
            texts=texts,
        )
        outcome = StreamOutcome()
        events: AsyncGenerator[str, None]
        if isinstance(request, ChatCompletionRequest):
            events = chat_stream(ctx, generation, first, deltas, outcome, reading)
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

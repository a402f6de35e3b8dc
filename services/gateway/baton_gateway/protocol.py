"""Pydantic models of the OpenAI API as Baton serves it, with vLLM's extra sampling fields.

Requests: unknown fields are ignored (as vLLM does), so clients that send newer OpenAI fields keep
working; the fields Baton knows are range-checked here, and a violation becomes a 400 (never
FastAPI's 422). vLLM's extras (``top_k``, ``min_p``, ``ignore_eos``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``,
``return_token_ids``, ``return_tokens_as_token_ids``, ``truncate_prompt_tokens``,
``request_id``, ``priority``) are top-level fields; the OpenAI SDK's ``extra_body`` merges into the
top-level JSON, so both spellings arrive here the same way. ``logit_bias`` (token id -> bias) is
OpenAI's. Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``)
and its older ``guided_json``, ``guided_regex``, ``guided_choice`` and ``guided_grammar``; the
worker compiles them. Tool calling: ``tools``, ``tool_choice`` and ``parallel_tool_calls``
(``tools.py`` says how each choice is served).

Responses follow the OpenAI shapes, plus vLLM's ``stop_reason`` on each choice and
``max_model_len`` on each model card; when asked for, vLLM's ``prompt_logprobs``,
``prompt_token_ids`` and ``token_ids`` (absent when not asked for, where vLLM writes null).
vLLM's ``/tokenize`` and ``/detokenize`` take and give its shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    computed_field,
    field_validator,
    model_serializer,
    model_validator,
)

# A logprob of -inf cannot be written as JSON; vLLM writes this instead.
MIN_LOGPROB = -9999.0
MAX_LOGPROBS = 20
MAX_N = 128
MAX_BAD_WORDS = 128  # vLLM's default cap


def random_id(prefix: str, separator: str = "-") -> str:
    return f"{prefix}{separator}{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------
# Requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class StructuredOutputsSpec(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` field: exactly one of a JSON schema, a regular
    expression, choices, an EBNF grammar, or any JSON object."""

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None  # XGrammar's, as vLLM takes it
    disable_any_whitespace: bool = False

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="after")
    def _check_one(self) -> StructuredOutputsSpec:
        given = [k for k, v in self.kinds().items() if v is not None and v is not False]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, regex, choice, grammar, "
                f"json_object and structural_tag, got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("structured_outputs choice must be non-empty strings")
        return self

    def kinds(self) -> dict[str, Any]:
        return {
            "json": self.json_schema,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object,
            "structural_tag": self.structural_tag,
        }


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's ``response_format``, and vLLM's ``structural_tag`` type (XGrammar's structural
    tag: its ``format``, or the older ``structures`` and ``triggers``, kept as given)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    model_config = ConfigDict(extra="allow")


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completions: sampling, stopping and streaming."""

    model: str | None = None  # None: the served model
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)  # None: 1.0
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias, clamped to +-100
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = Field(default=None, ge=-1)  # -1 or 0: disabled
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # prompt_token_ids and token_ids in the response
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:{id}"
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last N; -1: all
    request_id: str | None = Field(default=None, min_length=1)  # the response id's suffix
    priority: int = Field(default=0, ge=-(2**31), lt=2**31)  # lower first (priority policy)
    # vLLM's: arguments for the workers' custom logits processors (--logits-processors), their
    # SamplingParams.extra_args
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    # vLLM's: the request shares prefix-cache blocks only with requests of the same salt (so
    # that one tenant cannot learn from cache hits what another sent)
    cache_salt: str | None = None
    # vLLM's beam search: n beams per prompt, the n best returned (pipeline.py)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured output: OpenAI's response_format, vLLM's structured_outputs, and vLLM's
    # older guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsSpec | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys must be token ids, got {key!r}")
        return bias

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:  # (vLLM's words)
            raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
        return salt

    @field_validator("allowed_token_ids")
    @classmethod
    def _check_allowed_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not ids:
            raise ValueError("must not be empty")
        if ids is not None and any(t < 0 for t in ids):
            raise ValueError("token ids must be non-negative")
        return ids

    @field_validator("prompt_logprobs")
    @classmethod
    def _check_prompt_logprobs(cls, num: int | None, info: ValidationInfo) -> int | None:
        if num is not None and info.data.get("stream"):  # (stream is checked before)
            raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
        return num

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncate_prompt_tokens(cls, keep: int | None) -> int | None:
        if keep == 0:
            raise ValueError("must be >= 1 or -1")
        return keep

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        _ = self.structured  # raises for more than one constraint, or an incomplete one
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if self.use_beam_search:
            self._check_beam_search()
        return self

    def _check_beam_search(self) -> None:
        """What beam search cannot be combined with here (each a clear 400)."""
        if 2 * self.n > MAX_LOGPROBS:
            raise ValueError(
                f"n (the beam width) must be at most {MAX_LOGPROBS // 2} with use_beam_search"
            )
        for name, given in (
            ("stream", self.stream),
            ("stop", bool(self.stop_strings)),
            ("logprobs", self.num_logprobs is not None),
            ("prompt_logprobs", self.prompt_logprobs is not None),
            ("structured output", self.structured is not None),
        ):
            if given:
                raise ValueError(f"use_beam_search does not support {name}")

    @property
    def num_logprobs(self) -> int | None:
        """Top-N logprobs to ask the worker for, or None for no logprobs (each request's)."""
        return None

    @property
    def structured(self) -> StructuredOutputsSpec | None:
        """The one structured-output constraint the request sets, or None."""
        given: list[StructuredOutputsSpec] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(StructuredOutputsSpec(json_object=True))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format json_schema needs json_schema.schema")
            given.append(StructuredOutputsSpec(json=fmt.json_schema.json_schema))
        elif fmt is not None and fmt.type == "structural_tag":
            tag = {"type": "structural_tag", **(fmt.model_extra or {})}
            if "format" not in tag and "structures" not in tag:
                raise ValueError("response_format structural_tag needs format (or structures)")
            given.append(StructuredOutputsSpec(structural_tag=tag))
        if self.structured_outputs is not None:
            given.append(self.structured_outputs)
        guided: dict[str, Any] = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        given += [
            StructuredOutputsSpec.model_validate({k: v}) for k, v in guided.items() if v is not None
        ]
        if len(given) > 1:
            raise ValueError(
                "set at most one of response_format (json_object or json_schema), "
                "structured_outputs and the guided_* fields"
            )
        return given[0] if given else None

    @property
    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` by token id, each bias clamped to [-100, 100] (as OpenAI and vLLM)."""
        return {int(k): min(100.0, max(-100.0, v)) for k, v in (self.logit_bias or {}).items()}

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One input message. Extra keys (``name``, ``tool_calls``, ``tool_call_id``...) are kept and
    handed to the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatPrompt(OpenAIBaseModel):
    """The fields that render a conversation into a prompt: chat completions and ``/tokenize``
    take the same ones (vLLM's chat extras), so both give the same token ids."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatCompletionTool] | None = None
    chat_template: str | None = None  # overrides the model's (and the server's) template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents a RAG template renders (transformers' ``documents``: each a dict,
    # typically "title" and "text")
    documents: list[dict[str, str]] | None = None
    # OpenAI's: reaches the template, for those that read it (gpt-oss's)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _check_chat_prompt(self) -> ChatPrompt:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.tools is not None and not self.tools:  # vLLM's check, in its words
            raise ValueError(
                "`tools` must not be an empty array. Either provide at least one tool or omit "
                "the field entirely."
            )
        return self


class ChatCompletionRequest(_SamplingRequest, ChatPrompt):
    # Deprecated by OpenAI in favour of max_completion_tokens, which wins when both are set.
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # None: "auto" when tools are given, else "none" (OpenAI's defaults).
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (--reasoning-parser)
    # vLLM's: the answer starts with the last message's content when it has the answer's role
    # (continuing a partial assistant message with add_generation_prompt false).
    echo: bool = False

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("when using top_logprobs, logprobs must be set to true")
        # vLLM's checks, in its words.
        choice = self.tool_choice
        if choice is not None and choice != "none" and self.tools is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if isinstance(choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if choice.function.name not in names:
                raise ValueError(
                    f"Tool '{choice.function.name}' has not been passed in `tools`; the tools "
                    f"are: {', '.join(names)}"
                )
        if self.effective_tool_choice in ("required", "named") and super().structured:
            raise ValueError(
                "You can only either use structured outputs or a required or named "
                "`tool_choice`, not both."
            )
        return self

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required", "named"]:
        """How the request uses its tools ("named": ``tool_choice`` names a function)."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return "named"
        if choice is None:
            return "auto" if self.tools else "none"
        return choice

    @property
    def structured(self) -> StructuredOutputsSpec | None:
        """As for every request; a required or named ``tool_choice`` is served as a JSON
        schema (see ``tools.py``)."""
        from baton_gateway.tools import tool_call_schema

        schema = tool_call_schema(self)
        if schema is not None:
            return StructuredOutputsSpec(json=schema)
        return super().structured

    def response_role(self, server_role: str) -> str:
        """The answer's role (vLLM's rule): the server's after a generation prompt, else the
        last message's (the answer continues it)."""
        return server_role if self.add_generation_prompt else self.messages[-1].role

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top-N logprobs to ask the worker for, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | list[str] | list[int] | list[list[int]]


def check_prompt(prompt: PromptInput) -> None:
    """Reject empty prompt lists and negative token ids (an empty string is checked once it is
    tokenized: with a BOS token it is a valid prompt)."""
    if isinstance(prompt, str):
        return
    if not prompt:
        raise ValueError("prompt must not be empty")
    for item in prompt:
        if isinstance(item, int):
            if item < 0:
                raise ValueError("token ids must be non-negative")
        elif isinstance(item, list):
            if not item:
                raise ValueError("prompt must not be empty")
            if any(t < 0 for t in item):
                raise ValueError("token ids must be non-negative")


class CompletionRequest(_SamplingRequest):
    # None (or "", []): only prompt_embeds
    prompt: PromptInput | None = None
    # vLLM's: prompts as input embeddings, each a base64 torch.save'd tensor [length, hidden
    # size] (the workers need --enable-prompt-embeds); their choices come before the prompts'
    prompt_embeds: str | list[str] | None = None
    # 16 is OpenAI's and vLLM's default; None: all the context the prompt leaves.
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal n)")
        if self.embeds_list:
            if self.echo:  # (vLLM's words)
                raise ValueError("Echo is unsupported with prompt embeds.")
            if self.use_beam_search:
                raise ValueError("use_beam_search is unsupported with prompt embeds")
            if self.prompt in ("", []):
                self.prompt = None  # (the OpenAI SDK requires a prompt: "" goes with embeds)
        elif self.prompt is None:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        if self.prompt is not None:
            check_prompt(self.prompt)
        return self

    @property
    def embeds_list(self) -> list[str]:
        """``prompt_embeds`` as a list (empty: none)."""
        embeds = self.prompt_embeds
        return [embeds] if isinstance(embeds, str) else list(embeds or ())

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


# ---------------------------------------------------------------------------------------------
# Responses


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


def _is_none(value: Any) -> bool:
    return value is None


def _only_if_set() -> Any:
    """A field that is left out of the JSON when None (vLLM's optional outputs)."""
    return Field(default=None, exclude_if=_is_none)


class PromptLogprob(OpenAIBaseModel):
    """vLLM's logprob of one prompt token or of one of its alternatives."""

    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# ``prompt_logprobs``: per prompt token, None for the first (nothing precedes it), else token id ->
# logprob for the prompt's own token and the top N alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = MIN_LOGPROB
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _WithReasoning(OpenAIBaseModel):
    reasoning: str | None = None  # vLLM's, with --reasoning-parser (reasoning.py)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def reasoning_content(self) -> str | None:
        """``reasoning`` under its older name (DeepSeek's, vLLM's before), which many clients
        still read."""
        return self.reasoning


class ChatMessageOut(_WithReasoning):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # vLLM: the stop token id or stop string that matched
    token_ids: list[int] | None = _only_if_set()  # return_token_ids


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = _only_if_set()
    prompt_token_ids: list[int] | None = _only_if_set()  # return_token_ids


class _DropNone(OpenAIBaseModel):
    """Serialises only the fields that are set."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_DropNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_DropNone):
    """A piece of tool call ``index``: its first piece has ``id``, ``type`` and the
    function's name; ``function.arguments`` pieces are concatenated by the client."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_DropNone, _WithReasoning):
    """A chunk's delta: only the fields that are set appear (``{}`` on a final chunk)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _only_if_set()  # the chunk's tokens (return_token_ids)


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = _only_if_set()  # a choice's first chunk


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    """A choice of a whole response, or of one chunk of a stream (whose ``prompt_token_ids``
    come with the choice's first chunk and ``token_ids`` are the chunk's)."""

    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = _only_if_set()
    prompt_token_ids: list[int] | None = _only_if_set()  # return_token_ids
    token_ids: list[int] | None = _only_if_set()


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "baton"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# vLLM's tokenizer endpoints: /tokenize and /detokenize


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    model: str | None = None
    return_token_strs: bool = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


def tokenize_request(body: Any) -> TokenizeRequest:
    """A ``/tokenize`` body: a conversation when it has ``messages``, else a text (as in vLLM).
    Raises pydantic's ValidationError."""
    if isinstance(body, dict) and "messages" in body:
        return TokenizeChatRequest.model_validate(body)
    return TokenizeCompletionRequest.model_validate(body)


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # (vLLM's; the name decides)


class VersionResponse(OpenAIBaseModel):
    version: str

from baton.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling", "first_token_id", "first_token_logprobs", "kv_handle", "priority", "lora_name", "cache_salt", "prompt_embeds")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    first_token_id: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    kv_handle: _common_pb2.KVHandle
    priority: int
    lora_name: str
    cache_salt: str
    prompt_embeds: _common_pb2.PromptEmbeds
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prompt_embeds: _Optional[_Union[_common_pb2.PromptEmbeds, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "stop_token_id", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("req_id", "inputs", "dimensions", "normalize", "priority", "lora_name", "activation")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenIds]
    dimensions: int
    normalize: bool
    priority: int
    lora_name: str
    activation: bool
    def __init__(self, req_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_common_pb2.TokenIds, _Mapping]]] = ..., dimensions: _Optional[int] = ..., normalize: bool = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., activation: bool = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "num_prompt_tokens", "num_cached_tokens")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, values: _Optional[_Iterable[float]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("generate", "cancel_req_id", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateRequest
    cancel_req_id: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel_req_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GenerateStreamItem]
    def __init__(self, items: _Optional[_Iterable[_Union[GenerateStreamItem, _Mapping]]] = ...) -> None: ...

class GenerateStreamItem(_message.Message):
    __slots__ = ("req_id", "response", "error_code", "error_message")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    response: GenerateResponse
    error_code: int
    error_message: str
    def __init__(self, req_id: _Optional[str] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("req_ids",)
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("num_aborted",)
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    num_aborted: int
    def __init__(self, num_aborted: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("load",)
    LOAD_FIELD_NUMBER: _ClassVar[int]
    load: _common_pb2.WorkerLoad
    def __init__(self, load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "max_model_len", "vocab_size", "block_size", "eos_token_ids", "dtype", "metrics_url", "lora_modules", "labels")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    LORA_MODULES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    metrics_url: str
    lora_modules: _containers.RepeatedCompositeFieldContainer[LoRAModule]
    labels: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., metrics_url: _Optional[str] = ..., lora_modules: _Optional[_Iterable[_Union[LoRAModule, _Mapping]]] = ..., labels: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset",)
    RESET_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    def __init__(self, reset: bool = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level", "mode")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    level: int
    mode: str
    def __init__(self, level: _Optional[int] = ..., mode: _Optional[str] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: bool = ...) -> None: ...

class IsSleepingRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsSleepingResponse(_message.Message):
    __slots__ = ("is_sleeping",)
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    is_sleeping: bool
    def __init__(self, is_sleeping: bool = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode", "clear_cache")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_CACHE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    clear_cache: bool
    def __init__(self, mode: _Optional[str] = ..., clear_cache: bool = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IsPausedResponse(_message.Message):
    __slots__ = ("is_paused",)
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    is_paused: bool
    def __init__(self, is_paused: bool = ...) -> None: ...

class StartProfileRequest(_message.Message):
    __slots__ = ("prefix",)
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    prefix: str
    def __init__(self, prefix: _Optional[str] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadWeightsResponse(_message.Message):
    __slots__ = ("num_ranks",)
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    num_ranks: int
    def __init__(self, num_ranks: _Optional[int] = ...) -> None: ...

class LoRAModule(_message.Message):
    __slots__ = ("name", "path", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "sampling", "priority", "lora_name", "cache_salt", "prompt_embeds")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    priority: int
    lora_name: str
    cache_salt: str
    prompt_embeds: _common_pb2.PromptEmbeds
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., prompt_embeds: _Optional[_Union[_common_pb2.PromptEmbeds, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprobs", "finish_reason", "kv_handle", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    finish_reason: _common_pb2.FinishReason
    kv_handle: _common_pb2.KVHandle
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

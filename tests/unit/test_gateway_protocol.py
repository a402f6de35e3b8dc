"""The gateway's OpenAI models, proto codec, length check and error mapping (no server)."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from pydantic import ValidationError

from baton.v1 import common_pb2, engine_pb2
from baton_gateway import codec
from baton_gateway.client import rpc_error
from baton_gateway.errors import GatewayError, error_response
from baton_gateway.pipeline import check_length
from baton_gateway.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    CompletionRequest,
    CompletionResponseChoice,
    DeltaMessage,
)
from baton_gateway.streaming import SSE_DONE, sse_event

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**kwargs: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **kwargs})


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.5},
        {"top_p": 0},
        {"top_p": 1.5},
        {"n": 0},
        {"max_tokens": 0},
        {"max_completion_tokens": 0},
        {"presence_penalty": 3},
        {"logprobs": True, "top_logprobs": 21},
        {"top_logprobs": 2},
        {"stream_options": {"include_usage": True}},
        {"min_p": 1.5},
        {"top_k": -2},
        {"repetition_penalty": 0},
        {"min_tokens": -1},
        {"stop_token_ids": [-1]},
        {"logit_bias": {"a": 2.0}},
        {"logit_bias": {"-1": 2.0}},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-3]},
        {"response_format": {"type": "xml"}},
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        {"response_format": {"type": "structural_tag"}},  # (neither format nor structures)
        {"guided_regex": "a+", "guided_choice": ["a"]},
        {"structured_outputs": {}},
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": {"regex": "a+", "grammar": 'root ::= "a"'}},
        {"messages": []},
        {"prompt_logprobs": 21},
        {"prompt_logprobs": -1},
        {"prompt_logprobs": 1, "stream": True},  # as vLLM: not when streaming
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": -2},
        {"request_id": ""},
    ],
)
def test_chat_rejects_out_of_range(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        chat(**bad)


def test_chat_accepts_vllm_extras_and_ignores_unknown_fields() -> None:
    req = chat(
        top_k=5,
        min_p=0.1,
        ignore_eos=True,
        min_tokens=3,
        repetition_penalty=1.2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        stop="x",
        some_future_openai_field={"a": 1},
        max_tokens=10,
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    assert (req.top_k, req.min_p, req.ignore_eos, req.min_tokens) == (5, 0.1, True, 3)
    assert req.stop_strings == ["x"] and req.requested_max_tokens == 4 and req.num_logprobs == 2
    assert chat(logprobs=True).num_logprobs == 0 and chat().num_logprobs is None


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [
        ("text", True),
        (["a", "b"], True),
        ([1, 2, 3], True),
        ([[1, 2], [3]], True),
        ([], False),
        ([[]], False),
        ([1, "a"], False),
        ([-1], False),
    ],
)
def test_completion_prompt_forms(prompt: Any, ok: bool) -> None:
    if ok:
        assert CompletionRequest(prompt=prompt).prompt == prompt
    else:
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=prompt)


def test_completion_rejects_unsupported() -> None:
    for bad in ({"suffix": "x"}, {"best_of": 3}, {"logprobs": 21}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **bad})
    assert CompletionRequest(prompt="x").max_tokens == 16  # OpenAI's default


def test_completion_prompt_embeds() -> None:
    """vLLM's prompt_embeds: alone, with the OpenAI SDK's required empty prompt (then none),
    or with prompts; never with echo or beam search; and a prompt of one kind is needed."""
    alone = CompletionRequest.model_validate({"prompt_embeds": "AAAA"})
    assert alone.prompt is None and alone.embeds_list == ["AAAA"]
    for empty in ("", []):
        sdk = CompletionRequest.model_validate({"prompt": empty, "prompt_embeds": ["A", "B"]})
        assert sdk.prompt is None and sdk.embeds_list == ["A", "B"]
    both = CompletionRequest.model_validate({"prompt": "x", "prompt_embeds": "AAAA"})
    assert both.prompt == "x" and both.embeds_list == ["AAAA"]
    assert CompletionRequest.model_validate({"prompt": "x", "prompt_embeds": []}).embeds_list == []
    for body, message in (
        ({"prompt_embeds": "AAAA", "echo": True}, "Echo is unsupported with prompt embeds"),
        ({"prompt_embeds": "AAAA", "use_beam_search": True}, "beam_search is unsupported"),
        ({}, "Either prompt or prompt_embeds"),
        ({"prompt_embeds": []}, "Either prompt or prompt_embeds"),
        ({"prompt_embeds": [1]}, "valid string"),
    ):
        with pytest.raises(ValidationError, match=message):
            CompletionRequest.model_validate(body)


def test_stream_chunk_json_shape() -> None:
    role = ChatCompletionResponseStreamChoice(index=0, delta=DeltaMessage(role="assistant"))
    last = ChatCompletionResponseStreamChoice(index=1, delta=DeltaMessage(), finish_reason="stop")
    chunk = ChatCompletionStreamResponse(id="c", created=1, model="m", choices=[role, last])
    event = sse_event(chunk.model_dump_json())
    assert event.startswith("data: {") and event.endswith("}\n\n") and "\n" not in event[:-2]
    body = json.loads(event.removeprefix("data: "))
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"][0]["delta"] == {"role": "assistant"}
    assert body["choices"][0]["finish_reason"] is None
    assert body["choices"][1]["delta"] == {} and body["choices"][1]["finish_reason"] == "stop"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_error_body() -> None:
    body = error_response(404, "The model `x` does not exist.", "model").model_dump()
    assert body == {
        "error": {
            "message": "The model `x` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert GatewayError(400, "bad").to_response().error.type == "BadRequestError"


def test_check_length() -> None:
    assert check_length(10, None, 512) == 502
    assert check_length(10, 502, 512) == 502
    with pytest.raises(GatewayError, match=r"maximum context length is 512 tokens.*10 in the"):
        check_length(10, 503, 512)
    with pytest.raises(GatewayError, match="your request has 512 input tokens"):
        check_length(512, None, 512)
    with pytest.raises(GatewayError, match="empty"):
        check_length(0, 5, 512)


def test_sampling_params_are_all_explicit() -> None:
    pb = codec.sampling_params(chat(), max_tokens=7, seed=None)
    assert (pb.temperature, pb.top_p, pb.top_k, pb.min_p) == (1.0, 1.0, 0, 0.0)
    assert (pb.repetition_penalty, pb.max_tokens, pb.min_tokens) == (1.0, 7, 0)
    assert not pb.HasField("seed") and not pb.HasField("logprobs")
    req = chat(temperature=0, top_p=0.5, top_k=-1, min_p=0.2, repetition_penalty=1.3,
               stop_token_ids=[5], ignore_eos=True, logprobs=True, top_logprobs=4)  # fmt: skip
    pb = codec.sampling_params(req, max_tokens=3, seed=42)
    assert (pb.temperature, pb.top_p, pb.top_k) == (0.0, 0.5, 0)
    assert pb.min_p == pytest.approx(0.2) and pb.repetition_penalty == pytest.approx(1.3)
    assert list(pb.stop_token_ids) == [5] and pb.ignore_eos and pb.seed == 42
    assert pb.logprobs == 4
    completion = CompletionRequest(prompt="x", logprobs=0)
    assert codec.sampling_params(completion, 1, None).logprobs == 0


def test_generation_defaults_fill_what_a_request_leaves_unset() -> None:
    """The model's generation config (vLLM's --generation-config) replaces vLLM's defaults
    only where the request sets nothing; a value the request sets, even 0, wins."""
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05}
    pb = codec.sampling_params(chat(), max_tokens=7, seed=None, defaults=defaults)
    assert (pb.temperature, pb.top_k, pb.min_p) == (pytest.approx(0.6), 20, 0.0)
    assert (pb.top_p, pb.repetition_penalty) == (pytest.approx(0.95), pytest.approx(1.05))
    pb = codec.sampling_params(
        chat(temperature=0, top_k=0, top_p=1, repetition_penalty=1), 7, None, defaults
    )
    assert (pb.temperature, pb.top_k, pb.top_p, pb.repetition_penalty) == (0.0, 0, 1.0, 1.0)


def test_logit_bias_and_allowed_token_ids_reach_the_engine() -> None:
    """Biases are clamped to [-100, 100] (OpenAI, vLLM); unset fields stay unset."""
    from baton_decode.codec import sampling_params_from_proto

    req = chat(logit_bias={"5": 250, "7": -3.5}, allowed_token_ids=[1, 2])
    engine = sampling_params_from_proto(codec.sampling_params(req, 3, None))
    assert engine.logit_bias == {5: 100.0, 7: -3.5} and engine.allowed_token_ids == [1, 2]
    plain = sampling_params_from_proto(codec.sampling_params(chat(), 3, None))
    assert plain.logit_bias is None and plain.allowed_token_ids is None


def test_bad_words_reach_the_worker_as_token_ids() -> None:
    from baton_decode.codec import sampling_params_from_proto

    pb = codec.sampling_params(chat(bad_words=["a b"]), 3, None, bad_words=[[5, 6], [7]])
    assert sampling_params_from_proto(pb).bad_words_token_ids == [[5, 6], [7]]
    assert (
        sampling_params_from_proto(codec.sampling_params(chat(), 3, None)).bad_words_token_ids
        is None
    )


def test_vllm_xargs_reach_the_worker_as_extra_args() -> None:
    from baton_decode.codec import sampling_params_from_proto

    xargs = {"target_token": 5, "mode": "strict", "weights": [0.5, 2]}
    pb = codec.sampling_params(chat(vllm_xargs=xargs), 3, None)
    assert sampling_params_from_proto(pb).extra_args == xargs
    assert sampling_params_from_proto(codec.sampling_params(chat(), 3, None)).extra_args is None
    with pytest.raises(ValidationError):
        chat(vllm_xargs={"nested": {"objects": "are not vLLM's"}})


def test_prompt_logprobs_reach_the_worker() -> None:
    """The worker computes the larger of vLLM's prompt_logprobs and an echo's logprobs."""

    def worker_prompt_logprobs(**fields: Any) -> int | None:
        pb = codec.sampling_params(CompletionRequest(prompt="x", **fields), 3, None)
        return pb.prompt_logprobs if pb.HasField("prompt_logprobs") else None

    assert worker_prompt_logprobs() is None
    assert worker_prompt_logprobs(logprobs=2) is None  # no echo: only the output's
    assert worker_prompt_logprobs(logprobs=2, echo=True) == 2
    assert worker_prompt_logprobs(prompt_logprobs=0) == 0
    assert worker_prompt_logprobs(prompt_logprobs=1, logprobs=3, echo=True) == 3
    assert worker_prompt_logprobs(prompt_logprobs=4, logprobs=3, echo=True) == 4
    pb = codec.sampling_params(chat(prompt_logprobs=5), 3, None)
    assert pb.prompt_logprobs == 5 and not pb.HasField("logprobs")


def test_prompt_logprobs_shape() -> None:
    """vLLM's: None for the first prompt token, then the token's own logprob and rank first,
    then the top N it is not among (ranks 1..N); token ids are JSON keys."""
    from baton_gateway.codec import TokenLogprob
    from baton_gateway.responses import prompt_logprobs

    lps = [
        TokenLogprob(7, -2.5, 3, ((1, -0.5), (2, -1.0), (7, -2.5))),
        TokenLogprob(1, -0.1, 1, ((1, -0.1), (4, -3.0), (5, -4.0))),
        TokenLogprob(9, float("-inf"), 50, ((2, -0.2), (3, -0.3), (4, -0.4))),
    ]
    out = prompt_logprobs(lambda t: f"<{t}>", lps, 2)
    assert out[0] is None and len(out) == 4
    assert [(t, e.rank) for t, e in out[1].items()] == [(7, 3), (1, 1), (2, 2)]
    assert [(t, e.rank) for t, e in out[2].items()] == [(1, 1), (4, 2)]  # its own is the top
    assert out[3][9].logprob == -9999.0 and out[3][9].decoded_token == "<9>"
    body = json.loads(
        CompletionResponseChoice(index=0, text="", prompt_logprobs=out).model_dump_json()
    )
    assert body["prompt_logprobs"][1]["7"] == {"logprob": -2.5, "rank": 3, "decoded_token": "<7>"}
    assert "token_ids" not in body and "prompt_token_ids" not in body  # only when asked for
    assert len(prompt_logprobs(str, lps, 0)[1]) == 1  # prompt_logprobs=0: the token alone


def test_structured_output_fields_reach_the_worker() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, ("json_object", True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": schema},
                }
            },
            ("json_schema", json.dumps(schema)),
        ),
        ({"guided_json": json.dumps(schema)}, ("json_schema", json.dumps(schema))),
        ({"guided_regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"guided_grammar": 'root ::= "a"'}, ("grammar", 'root ::= "a"')),
        ({"structured_outputs": {"json": schema}}, ("json_schema", json.dumps(schema))),
        ({"structured_outputs": {"json_object": True}}, ("json_object", True)),
        (
            {"response_format": {"type": "structural_tag", "structures": [], "triggers": ["<"]}},
            (
                "structural_tag",
                json.dumps({"type": "structural_tag", "structures": [], "triggers": ["<"]}),
            ),
        ),
        (
            {"structured_outputs": {"structural_tag": '{"format": {}}'}},
            ("structural_tag", '{"format": {}}'),
        ),
    ]
    for fields, want in cases:
        pb = codec.sampling_params(chat(**fields), max_tokens=7, seed=None)
        if want is None:
            assert not pb.HasField("structured_outputs")
            continue
        kind = pb.structured_outputs.WhichOneof("kind")
        assert (kind, getattr(pb.structured_outputs, kind)) == want, fields
    pb = codec.sampling_params(
        CompletionRequest(prompt="x", guided_choice=["yes", "no"]), max_tokens=1, seed=None
    )
    assert list(pb.structured_outputs.choice.choices) == ["yes", "no"]
    spec = {"regex": "a+", "disable_any_whitespace": True}
    pb = codec.sampling_params(chat(structured_outputs=spec), max_tokens=1, seed=None)
    assert pb.structured_outputs.disable_any_whitespace


def test_generate_chunk_decoding() -> None:
    lp = common_pb2.TokenLogprobs(token_ids=[7, 7, 9], logprobs=[-0.1, -0.1, -2.5], rank=1)
    pb = engine_pb2.GenerateResponse(
        token_ids=[7],
        logprobs=[lp],
        finish_reason=common_pb2.FINISH_REASON_STOP,
        stop_token_id=3,
        num_prompt_tokens=5,
        num_cached_tokens=4,
    )
    chunk = codec.generate_chunk(pb)
    assert chunk.token_ids == [7] and chunk.finish_reason == "stop" and chunk.stop_token_id == 3
    assert chunk.logprobs is not None
    (top_id, top_lp), second = chunk.logprobs[0].top
    assert top_id == 7 and top_lp == pytest.approx(-0.1) and second == (9, -2.5)
    running = codec.generate_chunk(engine_pb2.GenerateResponse(token_ids=[1, 2]))
    assert running.finish_reason is None and running.stop_token_id is None
    assert running.logprobs is None


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 503),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.INVALID_ARGUMENT, 400),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_rpc_error_mapping(code: grpc.StatusCode, status: int) -> None:
    md = grpc.aio.Metadata()
    err = rpc_error(grpc.aio.AioRpcError(code, md, md, details="the reason"), "w:1")
    assert err.status == status and "the reason" in err.message
    if status == 400:
        assert err.message == "the reason"  # the engine's message is meant for the client

"""Disaggregated serving with real processes: a kvstore, prefill and decode workers, gateways.

One stack serves every test of this module. Each gateway is pinned to one decode worker (and at
most one prefill worker), so each path is exercised on its own:

    gateway   decode worker        prefill worker        path
    agg       grpc                 -                     aggregated (local prefill)
    grpc      grpc                 nixl                  disaggregated, gRPC stream
    nixl      nixl                 nixl                  disaggregated, NIXL READ
    tcp       nixl, UCX_TLS=tcp    nixl, UCX_TLS=tcp     disaggregated, NIXL over TCP

The two "tcp" workers also run with ``--async-scheduling`` (the GPU's default: step N+1 launched
before step N's tokens are read), so both roles are checked in that mode too.
``--remote-prefill-threshold 0`` makes every request of the disaggregated gateways prefill
remotely. Workers run float32 so greedy tokens do not depend on how requests were batched.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
from procs import ENGINE_ARGS, Service, launch, stop, wait_all

from baton.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.integration

SYSTEM = (
    "You are Baton's test assistant. You answer questions about the weather, cooking, "
    "geography, history and simple arithmetic. Keep every answer short, friendly and precise. "
    "Never invent facts; say when you do not know. Use the metric system. "
) * 3
QUESTIONS = [
    f"Question {i}: what is {i} plus {i * 3}, and name a city starting with {chr(65 + i % 26)}?"
    for i in range(16)  # two waves of 8 concurrent requests per path
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, Service]]:
    services: dict[str, Service] = {}
    try:
        services["kvstore"] = launch("kvstore", ["--port", "0"])
        wait_all([services["kvstore"]])
        kv = ["--kvstore", services["kvstore"].address]
        tcp = {"UCX_TLS": "tcp"}
        asyn = ["--async-scheduling"]
        for name, kind, transfer, env, extra in (
            ("prefill", "prefill", "nixl", None, []),
            ("prefill_tcp", "prefill", "nixl", tcp, asyn),
            ("decode_grpc", "decode", "grpc", None, []),
            ("decode_nixl", "decode", "nixl", None, []),
            ("decode_tcp", "decode", "nixl", tcp, asyn),
        ):
            argv = ["--port", "0", "--worker-id", name, "--kv-transfer", transfer, *kv]
            services[name] = launch(kind, [*argv, *ENGINE_ARGS, *extra], env)
        wait_all(services.values())
        for name, decode, prefill in (
            ("gw_agg", "decode_grpc", None),
            ("gw_grpc", "decode_grpc", "prefill"),
            ("gw_nixl", "decode_nixl", "prefill"),
            ("gw_tcp", "decode_tcp", "prefill_tcp"),
        ):
            argv = ["--port", "0", "--decode-addr", services[decode].address]
            argv += ["--remote-prefill-threshold", "0", "--disable-uvicorn-access-log"]
            if prefill is not None:
                argv += ["--prefill-addr", services[prefill].address]
            services[name] = launch("gateway", argv)
        wait_all(services.values())
        yield services
    finally:
        stop(reversed(list(services.values())))


def _prompts(tokenizer: object) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
        text = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            messages, tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False).input_ids)  # type: ignore[operator]
    return out


def _text_completions(base_url: str, prompts: list[list[int]]) -> list[str]:
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
        gate = asyncio.Semaphore(8)

        async def one(prompt: list[int]) -> str:
            async with gate:
                r = await client.completions.create(
                    model="SmolLM2-135M-Instruct",
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
            return r.choices[0].text

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    return asyncio.run(run())


def test_greedy_outputs_identical_offline_aggregated_disaggregated(
    stack: dict[str, Service], tokenizer: object, default_model_dir: Path
) -> None:
    from baton import LLM, SamplingParams

    prompts = _prompts(tokenizer)
    llm = LLM(str(default_model_dir), dtype="float32", max_model_len=1024)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    offline = [o.outputs[0].text for o in outputs]
    del llm

    before = {name: stack[name].metrics() for name in ("decode_grpc", "decode_nixl", "decode_tcp")}
    for gateway in ("gw_agg", "gw_grpc", "gw_nixl", "gw_tcp"):
        served = _text_completions(stack[gateway].address, prompts)
        mismatches = [i for i, (a, b) in enumerate(zip(offline, served, strict=True)) if a != b]
        assert not mismatches, f"{gateway}: {[(offline[i], served[i]) for i in mismatches[:3]]}"

    for name in ("decode_grpc", "decode_nixl", "decode_tcp"):
        after = stack[name].metrics()
        pulled = after["baton:kv_transfer_blocks_total"] - before[name].get(
            "baton:kv_transfer_blocks_total", 0.0
        )
        assert pulled > 0, f"{name} pulled no KV"
        assert after.get("baton:kv_transfer_failures_total", 0.0) == 0.0, name


def test_shared_prefix_pulls_fewer_blocks(stack: dict[str, Service], tokenizer: object) -> None:
    decode = stack["decode_grpc"]
    prefix = "A brand new system prompt about sailing boats and the sea. " * 12

    def pulled_for(question: str) -> float:
        before = decode.metrics().get("baton:kv_transfer_blocks_total", 0.0)
        ids = tokenizer(prefix + question).input_ids  # type: ignore[operator]
        _text_completions(stack["gw_grpc"].address, [ids])
        return decode.metrics()["baton:kv_transfer_blocks_total"] - before

    first = pulled_for(" How do sails work?")
    second = pulled_for(" What is a keel for?")
    assert first >= 8
    assert 0 < second <= first - 7, (first, second)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_output_on_every_path(stack: dict[str, Service]) -> None:
    """OpenAI's response_format and vLLM's structured_outputs / guided_* fields, served
    aggregated and disaggregated (the prefill worker samples the first token under the
    grammar, the decode worker goes on from it): valid outputs, the same greedy text on every
    path, and a schema that does not compile is a 400 that leaves the stack serving."""
    messages = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]
    texts: dict[str, list[str]] = {}
    for gateway in ("gw_agg", "gw_grpc", "gw_nixl", "gw_tcp"):
        client = openai.OpenAI(
            base_url=f"{stack[gateway].address}/v1", api_key="none", max_retries=0
        )
        person = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0.0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON},
            },
        ).choices[0]
        assert person.finish_reason == "stop", person.message.content
        parsed = json.loads(person.message.content or "")
        assert set(parsed) == {"name", "age"} and isinstance(parsed["age"], int)
        choice = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="Is the sea salty? Answer:",
            max_tokens=10,
            temperature=1.0,
            seed=5,
            extra_body={"guided_choice": ["yes", "no", "it depends"]},
        ).choices[0]
        assert choice.text in ("yes", "no", "it depends")
        code = client.completions.create(
            model="SmolLM2-135M-Instruct",
            prompt="A ticket code:",
            max_tokens=10,
            temperature=0.0,
            extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}},
        ).choices[0]
        assert re.fullmatch("[A-Z]{2}-[0-9]{3}", code.text), code.text
        # vLLM's structural_tag response format (XGrammar's): one tagged JSON value here
        tag = {
            "type": "structural_tag",
            "format": {
                "type": "tag",
                "begin": "<person>",
                "content": {"type": "json_schema", "json_schema": PERSON},
                "end": "</person>",
            },
        }
        tagged = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0.0,
            extra_body={"response_format": tag},
        ).choices[0]
        body = tagged.message.content or ""
        assert body.startswith("<person>") and body.endswith("</person>"), body
        assert set(json.loads(body[len("<person>") : -len("</person>")])) == {"name", "age"}
        # A named tool choice is a JSON schema too (the function's parameters); "auto" needs
        # a tool parser, which these gateways were not started with.
        tool = {"type": "function", "function": {"name": "describe", "parameters": PERSON}}
        [call] = (
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,  # type: ignore[arg-type]
                max_tokens=60,
                temperature=0.0,
                tools=[tool],  # type: ignore[list-item]
                tool_choice={"type": "function", "function": {"name": "describe"}},
            )
            .choices[0]
            .message.tool_calls
            or []
        )
        assert set(json.loads(call.function.arguments)) == {"name", "age"}
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,  # type: ignore[arg-type]
                tools=[tool],  # type: ignore[list-item]
            )
        texts[gateway] = [
            person.message.content or "",
            choice.text,
            code.text,
            call.function.arguments,
            body,
        ]
        with pytest.raises(openai.BadRequestError, match="nope"):
            client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=messages,  # type: ignore[arg-type]
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "bad", "schema": {"type": "nope"}},
                },
            )
        with pytest.raises(openai.BadRequestError, match="at most one"):
            client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt="Hi",
                extra_body={"guided_regex": "a+", "guided_choice": ["a"]},
            )
        client.close()
    assert all(t == texts["gw_agg"] for t in texts.values()), texts


def test_prefill_priority_needs_the_priority_policy(stack: dict[str, Service]) -> None:
    """The prefill worker runs the default fcfs policy: a priority other than 0 is refused."""
    with grpc.insecure_channel(stack["prefill"].address) as channel:
        stub = engine_pb2_grpc.PrefillServiceStub(channel)  # type: ignore[no-untyped-call]
        sampling = common_pb2.SamplingParams(
            temperature=0.0, top_p=1.0, max_tokens=1, ignore_eos=True
        )
        request = engine_pb2.PrefillRequest(
            req_id="prio-1", prompt_token_ids=[1, 2, 3], sampling=sampling, priority=1
        )
        with pytest.raises(grpc.RpcError) as info:
            stub.Prefill(request, timeout=60)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "priority scheduling is not enabled" in info.value.details()
        request.req_id, request.priority = "prio-0", 0  # max_tokens 1: nothing is held after
        assert stub.Prefill(request, timeout=60).finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_pools_whole_and_leases_released_after_drain(stack: dict[str, Service]) -> None:
    time.sleep(0.5)  # the last requests' releases and the idle invariant checks
    for name in ("prefill", "prefill_tcp", "decode_grpc", "decode_nixl", "decode_tcp"):
        service = stack[name]
        assert service.alive, service.output()
        assert "engine loop died" not in "".join(service.lines), service.output()
        m = service.metrics()
        assert m["baton:num_requests_running"] == 0, name
        assert m["baton:kv_cache_usage_perc"] == 0.0, name  # nothing held: every block free
        assert m.get("baton:kv_leases_active", 0.0) == 0.0, name

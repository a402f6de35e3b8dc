"""The HTTP API under mutated requests: every answer is a success or an OpenAI-style 4xx, and
the stack keeps serving.

Valid bodies for each route are mutated (a field's value swapped for one of the wrong kind,
dropped, an unknown or vLLM field added, a nested field changed, the body cut short), with a
fixed seed so that a failure reproduces. This found a lone UTF-16 surrogate answered with a 500
and contradictory constraints that failed the engine's step (and then the engine)."""

from __future__ import annotations

import copy
import json
import os
import random
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.integration

NUM_REQUESTS = 400
SEED = int(os.environ.get("BATON_FUZZ_SEED", "44"))  # (other seeds: more cases)
MODEL = "SmolLM2-135M-Instruct"
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "42"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
    },
}
# A valid body per route, with most of the options each takes.
SEEDS: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "model": MODEL, "messages": MESSAGES, "max_tokens": 3, "temperature": 0.5,
        "top_p": 0.9, "n": 2, "stop": ["x"], "logprobs": True, "top_logprobs": 2,
        "tools": [TOOL], "tool_choice": "none", "response_format": {"type": "json_object"},
        "seed": 1, "presence_penalty": 0.1, "logit_bias": {"1": 1.0}, "min_tokens": 1,
    },
    "/v1/completions": {
        "model": MODEL, "prompt": "Hello", "max_tokens": 3, "echo": True, "logprobs": 2,
        "stop": "\n", "prompt_logprobs": 1, "truncate_prompt_tokens": 3, "bad_words": ["x"],
        "allowed_token_ids": [1, 2, 3], "guided_regex": "[a-z]+", "use_beam_search": False,
        "top_k": 5, "stop_token_ids": [2],
    },
    "/v1/embeddings": {
        "model": MODEL, "input": ["a", "b"], "encoding_format": "float", "dimensions": None,
    },
    "/pooling": {"model": MODEL, "input": "a", "encoding_format": "base64"},
    "/tokenize": {"model": MODEL, "prompt": "hello", "return_token_strs": True},
    "/detokenize": {"model": MODEL, "tokens": [1, 2, 3]},
    "/v1/responses": {
        "model": MODEL, "input": "hi", "max_output_tokens": 3, "instructions": "be brief",
        "store": True, "text": {"format": {"type": "text"}},
    },
    "/score": {"model": MODEL, "text_1": "a", "text_2": ["b", "c"]},
    "/rerank": {"model": MODEL, "query": "a", "documents": ["b", "c"], "top_n": 1},
}  # fmt: skip
# Values of every kind, the wrong one for most fields.
ODD_VALUES: list[Any] = [
    None, -1, 0, 1, 2**63, -(2**63), 1e308, 1e-308, -0.5, 3.5, True, False,
    "", "x" * 5000, "\u0000", "\ud83d", "[", "(?P<",
    [], {}, [None], [[]], [1, "a"], [-1], [2**40], [["a"]], {"a": 1}, {"1": "x"}, {"-5": 1},
    {"type": "weird"}, [{"role": "user"}], [{"role": "tool", "content": None}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
]  # fmt: skip
LIMITS = ("max_tokens", "max_output_tokens")
EXTRA_FIELDS = [
    "unknown", "priority", "cache_salt", "request_id", "add_generation_prompt",
    "continue_final_message", "chat_template_kwargs", "structural_tag", "guided_json",
    "guided_grammar", "skip_special_tokens", "include_stop_str_in_output", "ignore_eos",
    "min_p", "top_k", "repetition_penalty", "length_penalty", "max_completion_tokens",
    "parallel_tool_calls", "previous_response_id", "echo", "stream_options", "use_beam_search",
    "background", "documents", "reasoning_effort", "prompt_embeds", "reasoning",
]  # fmt: skip


def mutate(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    out = copy.deepcopy(body)
    for _ in range(rng.randint(1, 3)):
        op, keys = rng.random(), list(out)
        if op < 0.55 and keys:
            out[rng.choice(keys)] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif op < 0.7 and keys:
            del out[rng.choice(keys)]
        elif op < 0.85:
            out[rng.choice(EXTRA_FIELDS)] = copy.deepcopy(rng.choice(ODD_VALUES))
        else:  # inside a nested object
            for value in out.values():
                inner = value[0] if isinstance(value, list) and value else value
                if isinstance(inner, dict) and inner:
                    inner[rng.choice(list(inner))] = copy.deepcopy(rng.choice(ODD_VALUES))
                    break
    for limit in LIMITS:  # (any value but none: a generation stays short)
        if limit in body and out.get(limit) is None:
            out[limit] = body[limit]
    if "max_tokens" in body and rng.random() < 0.15:
        out["stream"] = True
    return out


def test_mutated_requests_get_answers_not_failures(http: httpx.Client) -> None:
    rng = random.Random(SEED)
    failures = []
    for i in range(NUM_REQUESTS):
        path = rng.choice(list(SEEDS))
        raw = json.dumps(mutate(SEEDS[path], rng))
        if rng.random() < 0.03:
            raw = raw[: rng.randint(0, len(raw))]  # cut short
        reply = http.post(path, content=raw, headers={"content-type": "application/json"})
        answered = reply.status_code < 500
        if reply.status_code >= 400:
            try:
                error = reply.json()["error"]
                answered = answered and isinstance(error["message"], str)
            except (ValueError, KeyError, TypeError):
                answered = False
        elif "text/event-stream" in reply.headers.get("content-type", ""):
            answered = reply.text.rstrip().endswith("data: [DONE]")
        if not answered:
            failures.append(f"#{i} {path} {raw[:300]} -> {reply.status_code} {reply.text[:300]}")
    assert not failures, "\n".join(failures)
    health = http.get("/health")
    assert health.status_code == 200
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200, ok.text

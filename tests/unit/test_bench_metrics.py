"""The serving benchmark's pure parts: percentiles, TPOT/ITL from fabricated timestamps,
goodput, SSE parsing of recorded byte streams, and the random dataset's exact lengths."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from baton.bench.client import StreamError, StreamTimer
from baton.bench.datasets import jsonl_requests, random_requests
from baton.bench.metrics import (
    RequestResult,
    calculate_metrics,
    meets_slos,
    parse_goodput,
    percentile,
    summarize,
)
from baton.bench.sse import MAX_EVENT_CHARS, SSEDecoder, SSEError


def ok(
    ttft: float, itl: list[float], latency: float, tokens: int, prompt_len: int = 10
) -> RequestResult:
    return RequestResult(
        prompt_len, True, ttft=ttft, itl=itl, latency=latency, output_tokens=tokens
    )


# --- percentiles and summaries -------------------------------------------------------------------


def test_percentile_interpolates_linearly() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 99) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summarize_converts_seconds_to_ms() -> None:
    s = summarize([0.010, 0.020, 0.030, 0.040], (50.0, 90.0, 99.0))
    assert s.count == 4
    assert s.mean == pytest.approx(25.0)
    assert s.median == pytest.approx(25.0)
    assert s.std == pytest.approx(float(np.std([10, 20, 30, 40])))
    assert s.percentiles == pytest.approx({50.0: 25.0, 90.0: 37.0, 99.0: 39.7})
    empty = summarize([], (99.0,))
    assert (empty.count, empty.mean, empty.percentiles) == (0, 0.0, {99.0: 0.0})


# --- TTFT, ITL and TPOT from fabricated timestamps ---------------------------------------------


def chat_chunk(content: str | None, finish: str | None = None) -> str:
    delta = {} if content is None else {"content": content}
    if content == "":
        delta["role"] = "assistant"
    return json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


def test_stream_timer_times_text_chunks_only() -> None:
    timer = StreamTimer(start=100.0)
    events = [
        (100.2, chat_chunk("")),  # role chunk: no text, not the first token
        (100.5, chat_chunk("Hello")),
        (100.7, chat_chunk(" wor")),
        (100.75, chat_chunk(None)),  # empty delta (held back text): not timed
        (101.0, chat_chunk("ld")),
        (101.1, chat_chunk(None, finish="length")),
        (101.1, json.dumps({"choices": [], "usage": {"completion_tokens": 4}})),
        (101.1, "[DONE]"),
    ]
    for now, payload in events:
        timer.on_event(payload, now, chat=True)
    assert timer.first == 100.5
    assert timer.itl == pytest.approx([0.2, 0.3])
    assert "".join(timer.texts) == "Hello world"
    assert timer.usage_tokens == 4
    assert timer.done
    with pytest.raises(StreamError, match="after \\[DONE\\]"):
        timer.on_event(chat_chunk("x"), 102.0, chat=True)


def test_stream_timer_completions_and_error_event() -> None:
    timer = StreamTimer(start=0.0)
    timer.on_event(json.dumps({"choices": [{"index": 0, "text": "a"}]}), 0.4, chat=False)
    assert timer.first == 0.4
    err = json.dumps({"error": {"message": "boom", "code": 500}})
    with pytest.raises(StreamError, match="boom"):
        timer.on_event(err, 0.5, chat=False)


def test_tpot_and_metrics_from_fabricated_requests() -> None:
    # ttft 0.1 s, then 4 more tokens in 0.4 s: TPOT = 0.1 s.
    a = ok(ttft=0.1, itl=[0.1, 0.1, 0.1, 0.1], latency=0.5, tokens=5)
    b = ok(ttft=0.3, itl=[0.2], latency=0.5, tokens=2)  # TPOT 0.2
    single = ok(ttft=0.2, itl=[], latency=0.2, tokens=1)  # no TPOT
    failed = RequestResult(10, False, error="HTTP 500")
    assert a.tpot == pytest.approx(0.1)
    assert b.tpot == pytest.approx(0.2)
    assert single.tpot is None
    m = calculate_metrics([a, b, single, failed], duration=2.0, percentiles=(50.0,))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (30, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(19.0)
    assert m.request_goodput is None
    assert m.ttft.mean == pytest.approx(200.0)
    assert m.tpot.count == 2 and m.tpot.mean == pytest.approx(150.0)
    assert m.itl.count == 5 and m.itl.mean == pytest.approx(120.0)
    assert m.e2el.percentiles[50.0] == pytest.approx(500.0)
    with pytest.raises(ValueError):
        calculate_metrics([a], duration=0.0)


# --- goodput -------------------------------------------------------------------------------------


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:3000"]) == {
        "ttft": 500.0,
        "tpot": 50.5,
        "e2el": 3000.0,
    }
    assert parse_goodput([]) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:abc"], ["ttft:0"], ["ttft:-1"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    fast = ok(ttft=0.1, itl=[0.02] * 9, latency=0.28, tokens=10)  # TPOT 20 ms
    slow_start = ok(ttft=0.6, itl=[0.02] * 9, latency=0.78, tokens=10)
    slow_tokens = ok(ttft=0.1, itl=[0.1] * 9, latency=1.0, tokens=10)  # TPOT 100 ms
    one_token = ok(ttft=0.1, itl=[], latency=0.1, tokens=1)  # TPOT counts as 0
    failed = RequestResult(10, False, error="x")
    slos = {"ttft": 500.0, "tpot": 50.0}
    assert [meets_slos(r, slos) for r in (fast, slow_start, slow_tokens, one_token, failed)] == [
        True,
        False,
        False,
        True,
        False,
    ]
    m = calculate_metrics([fast, slow_start, slow_tokens, one_token, failed], 4.0, slos=slos)
    assert m.request_goodput == pytest.approx(0.5)
    boundary = ok(ttft=0.5, itl=[], latency=0.5, tokens=1)
    assert meets_slos(boundary, {"ttft": 500.0})


# --- SSE parsing ---------------------------------------------------------------------------------

RECORDED = (
    b'data: {"choices":[{"index":0,"text":"caf\xc3\xa9"}]}\n\n'
    b": keep-alive comment\n\n"
    b'data: {"choices":[{"index":0,"text":" ok","finish_reason":"length"}]}\r\n\r\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}\n\n'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    '{"choices":[{"index":0,"text":"café"}]}',
    '{"choices":[{"index":0,"text":" ok","finish_reason":"length"}]}',
    '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}',
    "[DONE]",
]


def feed_all(parts: list[bytes]) -> list[str]:
    decoder = SSEDecoder()
    events = [e for part in parts for e in decoder.feed(part)]
    return events + decoder.flush()


def test_sse_whole_stream() -> None:
    assert feed_all([RECORDED]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_sse_chunks_split_anywhere(size: int) -> None:
    # Splits land inside "data:", inside the 2-byte "é", between "\r" and "\n", inside [DONE].
    parts = [RECORDED[i : i + size] for i in range(0, len(RECORDED), size)]
    assert feed_all(parts) == EXPECTED


def test_sse_every_single_split_point() -> None:
    for cut in range(len(RECORDED) + 1):
        assert feed_all([RECORDED[:cut], RECORDED[cut:]]) == EXPECTED, cut


# A chat stream recorded from `baton serve` (ids shortened): role chunk, three tokens (the last
# with the finish reason), the usage chunk, [DONE].
_CHUNK = (
    b'data: {"id":"chatcmpl-c06a","object":"chat.completion.chunk","created":1795948321,'
    b'"model":"SmolLM2-135M-Instruct","choices":[{"index":0,"delta":%s,"logprobs":null,'
    b'"finish_reason":%s,"stop_reason":null}],"usage":null}\n\n'
)
RECORDED_CHAT = (
    _CHUNK % (b'{"role":"assistant","content":""}', b"null")
    + _CHUNK % (b'{"content":"I"}', b"null")
    + _CHUNK % (b'{"content":"\'m"}', b"null")
    + _CHUNK % (b'{"content":" glad"}', b'"length"')
    + b'data: {"id":"chatcmpl-c06a","object":"chat.completion.chunk","created":1795948321,'
    b'"model":"SmolLM2-135M-Instruct","choices":[],"usage":{"prompt_tokens":32,'
    b'"completion_tokens":3,"total_tokens":35,"prompt_tokens_details":null}}\n\n'
    b"data: [DONE]\n\n"
)


def test_recorded_chat_stream_split_across_reads() -> None:
    decoder = SSEDecoder()
    timer = StreamTimer(start=0.0)
    reads = [RECORDED_CHAT[i : i + 100] for i in range(0, len(RECORDED_CHAT), 100)]
    for n, part in enumerate(reads, 1):
        for payload in decoder.feed(part):
            timer.on_event(payload, float(n), chat=True)
    assert decoder.flush() == []
    assert "".join(timer.texts) == "I'm glad"
    assert timer.usage_tokens == 3 and timer.done
    assert timer.first is not None and timer.first > 1.0  # not the role chunk
    assert len(timer.itl) == 2 and all(gap >= 0 for gap in timer.itl)


def test_sse_multiline_data_missing_final_blank_line_and_usage() -> None:
    stream = b"data: a\ndata: b\nevent: x\nid: 1\n\ndata:nospace\n\ndata: [DONE]"
    assert feed_all([stream]) == ["a\nb", "nospace", "[DONE]"]
    usage = json.loads(feed_all([RECORDED])[2])["usage"]
    assert usage["completion_tokens"] == 2


def test_sse_rejects_bad_streams() -> None:
    with pytest.raises(SSEError):
        SSEDecoder().feed(b"data: \xff\xfe\n\n")
    decoder = SSEDecoder()
    with pytest.raises(SSEError):
        for _ in range(MAX_EVENT_CHARS // (1 << 20) + 2):
            decoder.feed(b"x" * (1 << 20))


# --- datasets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("input_len", [1, 16, 128, 1000])
def test_random_prompts_have_exact_token_length(tokenizer: Any, input_len: int) -> None:
    samples = random_requests(tokenizer, 12, input_len, 7, seed=input_len)
    for s in samples:
        assert s.prompt_len == input_len
        assert len(tokenizer.encode(s.prompt, add_special_tokens=False)) == input_len
        assert s.output_len == 7
    assert len({s.prompt for s in samples}) == len(samples)
    again = random_requests(tokenizer, 12, input_len, 7, seed=input_len)
    assert [s.prompt for s in again] == [s.prompt for s in samples]


def test_random_prompts_range_ratio(tokenizer: Any) -> None:
    samples = random_requests(tokenizer, 40, 100, 50, seed=1, range_ratio=0.5)
    assert all(50 <= s.prompt_len <= 150 and 25 <= s.output_len <= 75 for s in samples)
    assert len({s.prompt_len for s in samples}) > 1
    for s in samples:
        assert len(tokenizer.encode(s.prompt, add_special_tokens=False)) == s.prompt_len
    with pytest.raises(ValueError):
        random_requests(tokenizer, 1, 10, 10, range_ratio=1.0)


def test_jsonl_requests(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello there", "output_len": 5}\n\n{"prompt": "Bye"}\n')
    samples = jsonl_requests(tokenizer, path, num_prompts=10, default_output_len=9)
    assert [(s.prompt, s.output_len) for s in samples] == [("Hello there", 5), ("Bye", 9)]
    assert samples[0].prompt_len == len(tokenizer.encode("Hello there", add_special_tokens=False))
    assert len(jsonl_requests(tokenizer, path, num_prompts=1, default_output_len=9)) == 1
    for bad in ('{"output_len": 3}', "not json", '{"prompt": "x", "output_len": 0}'):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=":1:"):
            jsonl_requests(tokenizer, path, 1, 9)

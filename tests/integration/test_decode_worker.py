"""The decode worker as a real process on loopback, driven by a real gRPC client.

Three workers are started: a shared one for most tests, a small one (``--max-pending 2``) for
the capacity and shutdown tests, which ends with SIGTERM, and one that schedules by priority.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from baton.v1 import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.integration

ENGINE_ARGS = ["--max-model-len", "512", "--kv-cache-memory", "268435456"]
READY = re.compile(r"baton decode ready on (\S+) \(metrics (\S+)\)")
RPC_TIMEOUT_S = 60.0  # no call may hang the suite


@dataclass
class Worker:
    proc: subprocess.Popen[str]
    address: str
    metrics_url: str
    log_path: Path
    channel: grpc.Channel
    stub: engine_pb2_grpc.DecodeServiceStub

    def log_tail(self) -> str:
        return self.log_path.read_text()[-3000:]


def _start_worker(log_path: Path, *extra: str) -> Worker:
    cmd = [sys.executable, "-m", "baton.cli", "decode", "--port", "0", "--metrics-port", "0"]
    log = log_path.open("w")
    proc = subprocess.Popen(
        [*cmd, *ENGINE_ARGS, *extra], stdout=subprocess.PIPE, stderr=log, text=True
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:  # keeps draining stdout so the worker can never block on a full pipe
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            match = READY.search(lines.get(timeout=0.5))
        except queue.Empty:
            match = None
            if proc.poll() is not None:
                break
        if match:
            channel = grpc.insecure_channel(match.group(1))
            stub = engine_pb2_grpc.DecodeServiceStub(channel)  # type: ignore[no-untyped-call]
            return Worker(proc, match.group(1), match.group(2), log_path, channel, stub)
    proc.kill()
    proc.wait()
    pytest.fail(f"the worker did not start:\n{log_path.read_text()[-3000:]}")


def _stop_worker(worker: Worker) -> None:
    worker.channel.close()
    if worker.proc.poll() is None:
        worker.proc.send_signal(signal.SIGTERM)
        try:
            worker.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = _start_worker(tmp_path_factory.mktemp("decode") / "worker.log")
    yield w
    _stop_worker(w)


@pytest.fixture(scope="module")
def small_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    log_path = tmp_path_factory.mktemp("decode-small") / "worker.log"
    w = _start_worker(log_path, "--max-pending", "2", "--shutdown-grace", "1")
    yield w
    _stop_worker(w)


@pytest.fixture(scope="module")
def priority_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """vLLM's priority scheduling, one request at a time (and room for more to wait)."""
    log_path = tmp_path_factory.mktemp("decode-priority") / "worker.log"
    argv = ("--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-pending", "8")
    w = _start_worker(log_path, *argv)
    yield w
    _stop_worker(w)


def _request(
    req_id: str, prompt: list[int], max_tokens: int = 8, priority: int = 0, **sampling: Any
) -> engine_pb2.GenerateRequest:
    params = {"temperature": 0.0, "top_p": 1.0, "ignore_eos": True, **sampling}
    return engine_pb2.GenerateRequest(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, **params),
        priority=priority,
    )


def _generate(worker: Worker, request: engine_pb2.GenerateRequest) -> list[Any]:
    return list(worker.stub.Generate(request, timeout=RPC_TIMEOUT_S))


def _load(worker: Worker) -> common_pb2.WorkerLoad:
    reply: engine_pb2.GetLoadResponse = worker.stub.GetLoad(
        engine_pb2.GetLoadRequest(), timeout=RPC_TIMEOUT_S
    )
    return reply.load


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the worker"
        time.sleep(0.05)


def test_health_and_model_info(worker: Worker) -> None:
    health = health_pb2_grpc.HealthStub(worker.channel)
    for service in ("", "baton.v1.DecodeService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    info = worker.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.max_model_len == 512 and info.vocab_size > 0 and info.block_size == 16
    assert info.model and list(info.eos_token_ids) and info.dtype
    assert info.metrics_url == worker.metrics_url


def test_greedy_stream_matches_offline_engine(worker: Worker, tokenizer: Any) -> None:
    from baton import LLM, SamplingParams

    prompt = list(tokenizer("A short poem about the river that runs to the sea:").input_ids)
    messages = _generate(worker, _request("greedy", prompt, max_tokens=20))
    streamed = [t for m in messages for t in m.token_ids]
    assert len(streamed) == 20
    assert [m.finish_reason for m in messages[:-1]] == [0] * (len(messages) - 1)
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert messages[-1].num_prompt_tokens == len(prompt)

    llm = LLM(max_model_len=512, kv_cache_memory=268435456)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    offline = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert streamed == offline[0].outputs[0].token_ids


def test_concurrent_streams_all_complete(worker: Worker) -> None:
    def run(i: int) -> list[int]:
        messages = _generate(worker, _request(f"conc-{i}", [100 + i, 200, 300 + i], 12))
        assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        return [t for m in messages for t in m.token_ids]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert [len(r) for r in results] == [12] * 8


def test_cancel_frees_the_request(worker: Worker) -> None:
    call = worker.stub.Generate(_request("cancel", [5, 6, 7, 8], 400), timeout=RPC_TIMEOUT_S)
    next(call), next(call)
    call.cancel()
    _wait_for(lambda: (load := _load(worker)).num_running == 0 and load.num_waiting == 0)
    assert _load(worker).kv_cache_usage == 0.0
    after = _generate(worker, _request("after-cancel", [5, 6, 7, 8], 4))
    assert sum(len(m.token_ids) for m in after) == 4


def test_abort_rpc_ends_the_stream(worker: Worker) -> None:
    call = worker.stub.Generate(_request("abort-me", [9, 10, 11], 400), timeout=RPC_TIMEOUT_S)
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        _generate(worker, _request("abort-me", [1, 2], 2))
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    reply = worker.stub.Abort(engine_pb2.AbortRequest(req_ids=["abort-me", "nope"]), timeout=10)
    assert reply.num_aborted == 1
    assert list(call)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "empty"),
        (list(range(1, 513)), {}, "max_model_len"),
        ([1, 10**7], {}, "out of range"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_input(worker: Worker, prompt: list[int], sampling: Any, message: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _generate(worker, _request("bad", prompt, **sampling))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_priority_needs_the_priority_policy(worker: Worker) -> None:
    """The default policy is fcfs: a priority other than 0 is refused, as vLLM refuses it."""
    with pytest.raises(grpc.RpcError) as info:
        _generate(worker, _request("prio-fcfs", [1, 2, 3], 2, priority=1))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority scheduling is not enabled" in info.value.details()
    assert len(_generate(worker, _request("prio-zero", [1, 2, 3], 2, priority=0))) >= 1


def test_calls_are_answered_while_a_grammar_compiles(worker: Worker) -> None:
    """A structured output's grammar compiles off the worker's event loop: a schema that takes
    XGrammar about a second to compile (3,000 required properties) does not hold up the load
    polls the gateway sends (a poll unanswered for 1 s marks the worker down)."""
    n = 3000
    schema = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "enum": [f"v{i}", f"w{i}"]} for i in range(n)},
        "required": [f"k{i}" for i in range(n)],
    }
    request = _request("big-schema", [42, 43, 44], 2)
    request.sampling.structured_outputs.json_schema = json.dumps(schema)
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        future = pool.submit(_generate, worker, request)
        polls = []
        while not future.done():
            t = time.monotonic()
            _load(worker)
            polls.append(time.monotonic() - t)
            time.sleep(0.02)
        took = time.monotonic() - start
        tokens = [t for m in future.result() for t in m.token_ids]
    assert len(tokens) == 2
    assert took > 0.5, f"the compile was too quick ({took:.2f} s) for this test to mean much"
    # A poll waiting on the compile would wait the whole of it (1-5 s); half the gateway's 1 s
    # leaves room for a loaded 2-core machine (0.29 s seen once with the compile at 5 s).
    assert max(polls) < 0.5, f"a load poll waited {max(polls):.2f} s (request: {took:.2f} s)"


def test_logprobs(worker: Worker) -> None:
    messages = _generate(worker, _request("lp", [42, 43, 44], 5, logprobs=3))
    for m in messages:
        assert len(m.logprobs) == len(m.token_ids)
        for token, lp in zip(m.token_ids, m.logprobs, strict=True):
            assert lp.token_ids[0] == token and len(lp.token_ids) == len(lp.logprobs) == 4
            assert lp.rank >= 1 and all(v <= 0 for v in lp.logprobs)
            assert lp.logprobs[0] == max(lp.logprobs)  # greedy took a most likely token
    no_lp = _generate(worker, _request("no-lp", [42, 43, 44], 2))
    assert all(not m.logprobs for m in no_lp)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = s.labels.get("finished_reason")
            samples[s.name + (f"[{extra}]" if extra else "")] = s.value
    return samples


def test_metrics_move_after_a_request(worker: Worker) -> None:
    before = _scrape(worker.metrics_url)
    for name in (
        "baton:num_requests_running",
        "baton:num_requests_waiting",
        "baton:kv_cache_usage_perc",
        "baton:prefix_cache_queries_total",
        "baton:prefix_cache_hits_total",
        "baton:num_preemptions_total",
        "baton:prompt_tokens_total",
        "baton:generation_tokens_total",
        "baton:time_to_first_token_seconds_count",
        "baton:inter_token_latency_seconds_count",
        "baton:e2e_request_latency_seconds_count",
    ):
        assert name in before, name
    _generate(worker, _request("metered", [7, 8, 9, 10, 11], 7))
    after = _scrape(worker.metrics_url)
    assert after["baton:generation_tokens_total"] - before["baton:generation_tokens_total"] == 7
    assert after["baton:prompt_tokens_total"] - before["baton:prompt_tokens_total"] == 5
    success = "baton:request_success_total[length]"
    assert after[success] - before.get(success, 0.0) == 1
    for name in ("time_to_first_token", "e2e_request_latency"):
        key = f"baton:{name}_seconds_count"
        assert after[key] - before[key] == 1
    itl = "baton:inter_token_latency_seconds_count"
    assert after[itl] > before[itl]
    # vLLM's phases of the request: queued then inference (prefill, decode) make up its e2e.
    moved = {
        name: after[f"baton:{name}_seconds_sum"] - before[f"baton:{name}_seconds_sum"]
        for name in (
            "e2e_request_latency",
            "request_queue_time",
            "request_prefill_time",
            "request_decode_time",
            "request_inference_time",
        )
    }
    for name in moved:
        assert after[f"baton:{name}_seconds_count"] - before[f"baton:{name}_seconds_count"] == 1
    assert moved["request_queue_time"] + moved["request_inference_time"] == pytest.approx(
        moved["e2e_request_latency"]
    )
    assert moved["request_prefill_time"] + moved["request_decode_time"] == pytest.approx(
        moved["request_inference_time"]
    )
    assert moved["request_decode_time"] > 0  # (six tokens after the first)
    max_tokens = "baton:request_params_max_tokens_sum"
    assert after[max_tokens] - before[max_tokens] == 7
    steps = "baton:iteration_tokens_total_count"
    assert after[steps] - before[steps] >= 7  # (a step per token at least; 5 prompt tokens)
    assert after["baton:cache_config_info"] == 1


def test_prefix_cache_hit_is_reported(worker: Worker) -> None:
    prompt = list(range(1000, 1040))  # two full 16-token blocks, then 8 more
    first = _generate(worker, _request("prefix-1", prompt, 2))
    hits_before = _scrape(worker.metrics_url)["baton:prefix_cache_hits_total"]
    second = _generate(worker, _request("prefix-2", prompt, 2))
    assert first[-1].num_cached_tokens == 0
    assert second[-1].num_cached_tokens == 32
    assert _scrape(worker.metrics_url)["baton:prefix_cache_hits_total"] - hits_before == 32


def test_over_capacity_is_resource_exhausted(small_worker: Worker) -> None:
    calls = [
        small_worker.stub.Generate(_request(f"long-{i}", [1, 2, 3], 400), timeout=RPC_TIMEOUT_S)
        for i in range(2)
    ]
    for call in calls:
        next(call)  # both admitted and running
    with pytest.raises(grpc.RpcError) as info:
        _generate(small_worker, _request("one-too-many", [1, 2, 3], 4))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    _wait_for(lambda: (load := _load(small_worker)).num_running + load.num_waiting == 0)
    assert len(_generate(small_worker, _request("fits-again", [1, 2, 3], 2))) >= 1


def _embed_request(req_id: str, *inputs: list[int], **fields: Any) -> engine_pb2.EmbedRequest:
    return engine_pb2.EmbedRequest(
        req_id=req_id, inputs=[common_pb2.TokenIds(token_ids=ids) for ids in inputs], **fields
    )


def test_embed(worker: Worker, small_worker: Worker) -> None:
    """One embedding per input, in order; a call of more inputs than the worker holds runs
    them as room frees; bad input fails the whole call before anything runs; a full worker
    answers RESOURCE_EXHAUSTED."""
    inputs = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8], [4, 4, 4]]
    reply = worker.stub.Embed(_embed_request("emb", *inputs), timeout=RPC_TIMEOUT_S)
    vectors = [list(e.values) for e in reply.embeddings]
    assert [e.num_prompt_tokens for e in reply.embeddings] == [len(i) for i in inputs]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 0
    for v in vectors:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4  # normalized
    # --max-pending 2 on the small worker: five inputs still run, two at a time.
    small = small_worker.stub.Embed(_embed_request("emb-small", *inputs), timeout=RPC_TIMEOUT_S)
    for e, want in zip(small.embeddings, vectors, strict=True):
        assert max(abs(a - b) for a, b in zip(e.values, want, strict=True)) < 1e-4
    raw = worker.stub.Embed(_embed_request("raw", inputs[0], normalize=False), timeout=60)
    norm = sum(x * x for x in raw.embeddings[0].values) ** 0.5
    assert norm > 1.5  # (a hidden state's size, not 1)
    assert (
        max(abs(a / norm - b) for a, b in zip(raw.embeddings[0].values, vectors[0], strict=True))
        < 1e-4
    )

    for request, message in [
        (_embed_request("bad", [1, 2], [10**7]), "out of range"),
        (_embed_request("none"), "at least one input"),
        (_embed_request("long", [1] * 513), "max_model_len"),
        (_embed_request("dims", [1, 2], dimensions=8), "Matryoshka"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            worker.stub.Embed(request, timeout=RPC_TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in str(info.value.details())
    assert _load(worker).num_running + _load(worker).num_waiting == 0

    calls = [
        small_worker.stub.Generate(_request(f"busy-{i}", [1, 2, 3], 400), timeout=RPC_TIMEOUT_S)
        for i in range(2)
    ]
    for call in calls:
        next(call)  # both admitted and running: the worker is full
    with pytest.raises(grpc.RpcError) as info:
        small_worker.stub.Embed(_embed_request("full", [1, 2]), timeout=RPC_TIMEOUT_S)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()
    _wait_for(lambda: (load := _load(small_worker)).num_running + load.num_waiting == 0)


class _Stream:
    """A ``GenerateStream`` call: ``send`` messages, ``read`` response messages."""

    def __init__(self, worker: Worker) -> None:
        self._outbox: queue.Queue[engine_pb2.GenerateStreamRequest | None] = queue.Queue()
        self.call = worker.stub.GenerateStream(self._messages(), timeout=RPC_TIMEOUT_S)

    def _messages(self) -> Iterator[engine_pb2.GenerateStreamRequest]:
        while (message := self._outbox.get()) is not None:
            yield message

    def generate(self, request: engine_pb2.GenerateRequest) -> None:
        self._outbox.put(engine_pb2.GenerateStreamRequest(generate=request))

    def cancel(self, req_id: str) -> None:
        self._outbox.put(engine_pb2.GenerateStreamRequest(cancel_req_id=req_id))

    def close(self) -> None:
        """No more requests: the call ends once the ones sent have."""
        self._outbox.put(None)

    def read_until_ended(self, req_ids: set[str]) -> dict[str, list[Any]]:
        """Items by request until each of ``req_ids`` ended (finish reason or error)."""
        items: dict[str, list[Any]] = {}
        pending = set(req_ids)
        while pending:
            for item in next(self.call).items:
                items.setdefault(item.req_id, []).append(item)
                if item.error_code or item.response.finish_reason:
                    pending.discard(item.req_id)
        return items


def test_generate_stream_multiplexes_requests(worker: Worker) -> None:
    """Requests over one call get the tokens Generate gives them, several per message, and a
    refused one fails alone."""
    stream = _Stream(worker)
    requests = [_request(f"mux-{i}", [40 + i, 41, 42 + i], 6 + 2 * i) for i in range(4)]
    for request in requests:
        stream.generate(request)
    stream.generate(_request("mux-bad", []))
    stream.close()
    items = stream.read_until_ended({r.req_id for r in requests} | {"mux-bad"})
    assert [(i.error_code, "empty" in i.error_message) for i in items["mux-bad"]] == [
        (grpc.StatusCode.INVALID_ARGUMENT.value[0], True)
    ]
    for request in requests:
        got = items[request.req_id]
        assert got[-1].response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        tokens = [t for item in got for t in item.response.token_ids]
        single = _generate(worker, _request(f"single-{request.req_id}", *_args(request)))
        assert tokens == [t for m in single for t in m.token_ids]
    assert list(stream.call) == []  # everything sent has ended: the call ends


def _args(request: engine_pb2.GenerateRequest) -> tuple[list[int], int]:
    return list(request.prompt_token_ids), request.sampling.max_tokens


def test_priority_policy_serves_the_best_ranked_first(
    priority_worker: Worker, worker: Worker
) -> None:
    """``--scheduling-policy priority``, one seat: the requests waiting behind a running one
    are served by priority (lower first), then by arrival; each gets the tokens it gets alone
    (under fcfs)."""
    stream = _Stream(priority_worker)
    stream.generate(_request("prio-running", [1, 2, 3], 96, priority=5))
    assert any(i.req_id == "prio-running" for i in next(stream.call).items)  # it holds the seat
    waiting = [
        _request(f"prio-{name}", [50 + i, 51, 52 + i], 4, priority=priority)
        for i, (name, priority) in enumerate((("a", 3), ("b", -2), ("c", 3), ("d", 0)))
    ]
    for request in waiting:
        stream.generate(request)
    stream.close()
    served: list[str] = []  # in the order their first tokens came
    tokens: dict[str, list[int]] = {}
    for message in stream.call:
        for item in message.items:
            assert not item.error_code, item.error_message
            if item.req_id not in served:
                served.append(item.req_id)
            tokens.setdefault(item.req_id, []).extend(item.response.token_ids)
    assert served == ["prio-running", "prio-b", "prio-d", "prio-a", "prio-c"]  # fcfs: a b c d
    for request in waiting:
        alone = _generate(worker, _request("alone-" + request.req_id, *_args(request)))
        assert tokens[request.req_id] == [t for m in alone for t in m.token_ids]


def test_generate_stream_cancel_and_call_end_free_requests(small_worker: Worker) -> None:
    stream = _Stream(small_worker)
    for i in range(3):
        stream.generate(_request(f"mux-long-{i}", [1, 2, 3 + i], 400))
    # --max-pending 2: the third is refused, the first two run.
    refused = stream.read_until_ended({"mux-long-2"})["mux-long-2"]
    assert refused[-1].error_code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    stream.cancel("mux-long-0")
    ended = stream.read_until_ended({"mux-long-0"})["mux-long-0"]
    assert ended[-1].response.finish_reason == common_pb2.FINISH_REASON_ABORT
    # The other one goes on.
    assert any(i.req_id == "mux-long-1" and i.response.token_ids for i in next(stream.call).items)
    _wait_for(lambda: (load := _load(small_worker)).num_running + load.num_waiting == 1)
    stream.call.cancel()  # the gateway went away: its requests are aborted and freed
    _wait_for(lambda: (load := _load(small_worker)).num_running + load.num_waiting == 0)
    assert _load(small_worker).kv_cache_usage == 0.0


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_sigterm_drains_then_exits_cleanly(small_worker: Worker) -> None:
    proc = small_worker.proc
    short = small_worker.stub.Generate(_request("short", [4, 5, 6], 10), timeout=30)
    long = small_worker.stub.Generate(_request("long", [4, 5, 7], 400), timeout=30)
    next(long)
    children = _children(proc.pid)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    # The short request finishes inside the 1 s grace; the long one is aborted after it.
    assert list(short)[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert list(long)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert proc.wait(timeout=15) == 0, small_worker.log_tail()
    assert time.monotonic() - start < 8
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    assert "decode worker stopped" in small_worker.log_tail()

"""``baton serve`` as a process tree: it serves, and it leaves nothing behind when it ends."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from tiny_models import build_model

from baton import LLM, SamplingParams

pytestmark = pytest.mark.integration


SERVICES = ("kvstore", "prefill", "decode", "gateway")


def _services(server: Any) -> dict[str, psutil.Process]:
    """The serve process's children by service name."""
    out = {}
    for p in server.descendants():
        with contextlib.suppress(psutil.NoSuchProcess):
            cmd = p.cmdline()
            for name in SERVICES:
                if "baton.cli" in cmd and name in cmd:
                    out[name] = p
    return out


def _chat(server: Any) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4},
        timeout=60,
    )


def test_serve_answers_then_sigterm_stops_every_process(serve_launcher: Any) -> None:
    server = serve_launcher.start()
    try:
        services = _services(server)
        assert sorted(services) == sorted(SERVICES)  # disaggregated by default
        resp = _chat(server)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "SmolLM2-135M-Instruct"
    finally:
        elapsed, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert server.proc.returncode == 0, server.output()
    assert elapsed < 10, f"took {elapsed:.1f} s to stop"
    assert not survivors, f"left behind: {survivors}"
    assert not any(p.is_running() for p in services.values())


def test_dead_worker_is_restarted_and_dead_gateway_stops_serve(serve_launcher: Any) -> None:
    server = serve_launcher.start()
    try:
        services = _services(server)
        services["decode"].kill()
        deadline = time.monotonic() + 120
        while "decode exited with status" not in server.output(200):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.1)
        assert server.proc.poll() is None, server.output()  # the rest keeps serving
        while True:  # the restarted decode worker serves again
            resp = _chat(server)
            if resp.status_code == 200:
                break
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.5)
        restarted = _services(server)
        assert restarted["decode"].pid != services["decode"].pid

        restarted["gateway"].kill()  # without its front door the stack stops
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.proc.poll() not in (None, 0), server.output()
        assert "gateway exited unexpectedly" in server.output()
        services = restarted
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"
    assert not any(p.is_running() for p in services.values())


def _tiny_model_text(
    arch: str, prompt_len: int, tokenizer_dir: Path, out: Path, kv_cache_dtype: str = "auto"
) -> tuple[list[int], str]:
    """A tiny ``arch`` model saved in ``out``, a prompt of ``prompt_len`` token ids, and the
    offline engine's greedy text for it (10 tokens, float32, this KV cache)."""
    build_model(arch, tokenizer_dir, out)
    prompt = [10 + i for i in range(prompt_len)]
    llm = LLM(
        str(out), dtype="float32", max_model_len=512, kv_cache_memory=1 << 24,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return prompt, llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].text


def _helpers(service: Any) -> list[Any]:
    """The tensor-parallel helper ranks (spawned processes) of a service's process."""
    return [
        p for p in service.children(recursive=True) if any("spawn_main" in a for a in p.cmdline())
    ]


def test_tensor_parallel_serve_answers_as_one_process(
    serve_launcher: Any, default_model_dir: Path, tmp_path: Path
) -> None:
    """``baton serve MODEL --tensor-parallel-size 2`` (aggregated by default then): the decode
    worker runs rank 1 as a helper process, the greedy text equals the offline engine's in one
    process, and stopping the stack leaves no process behind."""
    prompt, want = _tiny_model_text("qwen2", 37, default_model_dir, tmp_path)
    server = serve_launcher.start(
        [str(tmp_path), "--tensor-parallel-size", "2", "--dtype", "float32"]
    )
    try:
        services = _services(server)
        assert sorted(services) == ["decode", "gateway"], server.output()
        helpers = _helpers(services["decode"])
        assert len(helpers) == 1, helpers
        resp = httpx.post(
            f"{server.base_url}/completions",
            json={"prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"
    assert not any(p.is_running() for p in helpers)


def test_a_dead_helper_rank_stops_its_worker_and_serve_restarts_it(
    serve_launcher: Any, default_model_dir: Path, tmp_path: Path
) -> None:
    """A tensor-parallel helper rank that dies ends its worker at once, with status 1 (its
    engine cannot step any more); ``baton serve`` restarts the worker, which then answers with
    the offline engine's text again."""
    prompt, want = _tiny_model_text("llama", 37, default_model_dir, tmp_path)
    server = serve_launcher.start([str(tmp_path), "-tp", "2", "--dtype", "float32"])
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    try:
        decode = _services(server)["decode"]
        (helper,) = _helpers(decode)
        helper.kill()
        deadline = time.monotonic() + 120
        while "decode exited with status 1" not in server.output(200):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.1)
        while True:  # the restarted worker serves again
            resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
            if resp.status_code == 200:
                break
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.5)
        assert resp.json()["choices"][0]["text"] == want
        restarted = _services(server)["decode"]
        assert restarted.pid != decode.pid
        helpers = _helpers(restarted)
        assert len(helpers) == 1
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"
    assert not any(p.is_running() for p in [decode, helper, *helpers])


@pytest.mark.parametrize(
    ("transfer", "tp_args", "ranks"),
    [
        ("grpc", ["-tp", "2"], {"prefill": 2, "decode": 2}),
        ("nixl", ["--prefill-tensor-parallel-size", "2"], {"prefill": 2, "decode": 1}),
        ("nixl", ["-tp", "2", "--prefill-tensor-parallel-size", "1"], {"prefill": 1, "decode": 2}),
        # an FP8 KV cache: its blocks gathered, pulled over NIXL and split, as bytes
        ("nixl", ["-tp", "2", "--kv-cache-dtype", "fp8"], {"prefill": 2, "decode": 2}),
    ],
    ids=["grpc-2to2", "nixl-2to1", "nixl-1to2", "nixl-2to2-fp8"],
)
def test_disaggregated_with_tensor_parallel_workers(
    transfer: str,
    tp_args: list[str],
    ranks: dict[str, int],
    serve_launcher: Any,
    default_model_dir: Path,
    tmp_path: Path,
) -> None:
    """``--mode disaggregated`` with workers split across ranks, each side any size: a split
    prefill worker gathers the prompt's whole blocks from its ranks, a split decode worker
    pulls whole blocks and gives each rank its heads; the greedy text equals the offline
    engine's. The model is a mixture of experts (with a shared expert and a dense layer): its
    experts split across the ranks too."""
    kv_cache_dtype = "fp8" if "fp8" in tp_args else "auto"
    prompt, want = _tiny_model_text("qwen2_moe", 53, default_model_dir, tmp_path, kv_cache_dtype)
    server = serve_launcher.start(
        [str(tmp_path), *tp_args, "--mode", "disaggregated", "--dtype", "float32",
         "--remote-prefill-threshold", "0", "--kv-transfer", transfer]
    )  # fmt: skip
    try:
        services = _services(server)
        assert sorted(services) == ["decode", "gateway", "kvstore", "prefill"], server.output()
        for role, n in ranks.items():
            assert len(_helpers(services[role])) == n - 1, role
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want
        metrics = httpx.get(f"{server.root_url}/metrics", timeout=10).text
        pulled = [m for m in metrics.splitlines() if m.startswith("baton:kv_transfer_blocks_total")]
        assert pulled and float(pulled[0].rsplit(" ", 1)[1]) == 4, pulled  # 53 tokens: 4 blocks
        assert not any(
            m.startswith("baton:kv_transfer_failures_total") and not m.endswith(" 0.0")
            for m in metrics.splitlines()
        ), metrics
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


def test_multi_step_serve_streams_the_single_step_text(
    serve_launcher: Any, default_model_dir: Path, tmp_path: Path
) -> None:
    """``baton serve MODEL --num-scheduler-steps 4`` (disaggregated: the decode worker runs the
    passes): a streamed greedy completion through the OpenAI SDK brings the offline engine's
    single-step text, several tokens a chunk."""
    prompt, want = _tiny_model_text("llama", 29, default_model_dir, tmp_path)
    server = serve_launcher.start(
        [str(tmp_path), "--dtype", "float32", "--num-scheduler-steps", "4"]
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        stream = client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=10,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        texts = [c.choices[0].text for c in stream if c.choices and c.choices[0].text]
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert "".join(texts) == want
    assert len(texts) <= 5, texts  # the prefill's token, then runs of 4, 4 and 1
    assert not survivors, f"left behind: {survivors}"


def _decode_counter(metrics: str, name: str) -> float:
    """The decode worker's value of counter ``name`` in a /metrics page."""
    for line in metrics.splitlines():
        if line.startswith(name + "{") and 'role="decode"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} of the decode worker in:\n{metrics}")


def test_a_draft_model_serves_disaggregated(
    serve_launcher: Any, default_model_dir: Path, tmp_path: Path
) -> None:
    """``baton serve MODEL --speculative-config '{"model": DRAFT, ...}'`` keeps the default
    disaggregated mode: the prefill worker loads no draft, the decode worker pulls the
    prompt's KV and computes its draft's own. The greedy text equals the offline engine's
    without drafts, and the model as its own draft keeps nearly all its drafts."""
    prompt, want = _tiny_model_text("llama", 53, default_model_dir, tmp_path)
    spec = json.dumps({"model": str(tmp_path), "num_speculative_tokens": 3})
    server = serve_launcher.start(
        [str(tmp_path), "--dtype", "float32", "--remote-prefill-threshold", "0",
         "--speculative-config", spec]
    )  # fmt: skip
    try:
        services = _services(server)
        assert sorted(services) == sorted(SERVICES), server.output()
        assert "--speculative-config" not in services["prefill"].cmdline()
        body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        resp = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == want
        metrics = httpx.get(f"{server.root_url}/metrics", timeout=10).text
        assert _decode_counter(metrics, "baton:kv_transfer_blocks_total") == 4  # (pulled)
        drafts = _decode_counter(metrics, "baton:spec_decode_num_draft_tokens_total")
        kept = _decode_counter(metrics, "baton:spec_decode_num_accepted_tokens_total")
        assert drafts >= 6 and kept >= 0.8 * drafts, (drafts, kept)
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


def test_sleep_mode_over_http(serve_launcher: Any, default_model_dir: Path, tmp_path: Path):
    """``baton serve --enable-sleep-mode`` with vLLM's dev endpoints: ``POST /sleep?level=N``
    puts both workers to sleep (503s for requests meanwhile, an OpenAI-style error), ``POST
    /wake_up?tags=weights`` wakes part, ``/wake_up`` the rest; then the prompt is prefilled
    remotely again and its KV pulled into the woken pool (registered again for NIXL, the
    prefill worker under a new epoch) without a failed pull, and the text is the offline
    engine's, at either level. A bad level is a 400."""
    prompt, want = _tiny_model_text("llama", 53, default_model_dir, tmp_path)
    server = serve_launcher.start(
        [str(tmp_path), "--dtype", "float32", "--remote-prefill-threshold", "0",
         "--enable-sleep-mode"],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id

    def text() -> str:
        out = client.completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    def is_sleeping() -> bool:
        resp = httpx.get(f"{server.root_url}/is_sleeping", timeout=10)
        assert resp.status_code == 200, resp.text
        return bool(resp.json()["is_sleeping"])

    def sleep_states() -> set[str]:
        """The states the workers' ``engine_sleep_state`` gauges are at (vLLM's metric)."""
        metrics = httpx.get(f"{server.root_url}/metrics", timeout=10).text
        lines = [x for x in metrics.splitlines() if x.startswith("baton:engine_sleep_state{")]
        assert len(lines) == 6, lines  # (3 states, 2 workers)
        return {x.split('sleep_state="')[1].split('"')[0] for x in lines if x.endswith(" 1.0")}

    try:
        assert text() == want
        assert sleep_states() == {"awake"}
        for level, pulled in ((1, 8), (2, 12)):
            resp = httpx.post(f"{server.root_url}/sleep", params={"level": level}, timeout=60)
            assert resp.status_code == 200, resp.text
            assert is_sleeping()
            assert sleep_states() == {("weights_offloaded", "discard_all")[level - 1]}
            with pytest.raises(openai.APIStatusError) as refused:
                text()
            assert refused.value.status_code == 503
            assert "asleep" in refused.value.message
            url = f"{server.root_url}/wake_up"
            assert httpx.post(url, params={"tags": "weights"}, timeout=60).status_code == 200
            assert is_sleeping()
            if level == 2:  # (vLLM's sequence: the weights read in place before the KV cache)
                rpc = {"method": "reload_weights"}
                resp = httpx.post(f"{server.root_url}/collective_rpc", json=rpc, timeout=60)
                assert resp.status_code == 200 and resp.json() == {"results": [None, None]}
            assert httpx.post(url, timeout=60).status_code == 200
            assert not is_sleeping() and sleep_states() == {"awake"}
            assert text() == want
            metrics = httpx.get(f"{server.root_url}/metrics", timeout=10).text
            assert _decode_counter(metrics, "baton:kv_transfer_blocks_total") == pulled
            assert _decode_counter(metrics, "baton:kv_transfer_failures_total") == 0
        resp = httpx.post(f"{server.root_url}/sleep", params={"level": 3}, timeout=60)
        assert resp.status_code == 400 and "1 or 2" in resp.json()["error"]["message"]
        rpc = {"method": "reload_weights"}  # (awake and idle: the checkpoint read again)
        resp = httpx.post(f"{server.root_url}/collective_rpc", json=rpc, timeout=60)
        assert resp.status_code == 200, resp.text
        assert text() == want
        for body in ({"method": "init_device"}, {"args": []}, [1]):
            resp = httpx.post(f"{server.root_url}/collective_rpc", json=body, timeout=60)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "method"
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


class _Stream:
    """A streamed greedy completion read on a thread: its text and token count as they come,
    and its finish reason."""

    def __init__(self, client: openai.OpenAI, model: str, prompt: list[int], length: int) -> None:
        self.text, self.tokens, self.finish = "", 0, None
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=length, temperature=0.0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        self._chunks = iter(stream)
        self._read(next(self._chunks))
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self.done = self._pool.submit(self._read_all)

    def _read(self, chunk: Any) -> None:
        if chunk.choices:
            self.text += chunk.choices[0].text
            self.finish = chunk.choices[0].finish_reason or self.finish
        if chunk.usage is not None:
            self.tokens = chunk.usage.completion_tokens

    def _read_all(self) -> None:
        for chunk in self._chunks:
            self._read(chunk)

    def result(self, timeout: float = 120) -> tuple[int, str | None, str]:
        self.done.result(timeout)
        self._pool.shutdown()
        return self.tokens, self.finish, self.text


def test_sleep_aborts_waits_for_or_keeps_the_requests_in_flight(serve_launcher: Any) -> None:
    """``POST /sleep`` while a completion streams: by default (vLLM's ``mode=abort``) it ends at
    once with finish reason "abort" and the workers sleep; with ``mode=wait`` it runs to its
    length first (the sleep answers after), and a request sent meanwhile gets a 503; with
    ``mode=keep`` it stops while the workers sleep and, once they are woken, goes on to the
    text of a run never put to sleep."""
    server = serve_launcher.start(
        ["--enable-sleep-mode", "--max-model-len", "2048"], env={"VLLM_SERVER_DEV_MODE": "1"}
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompt = [10 + i for i in range(20)]

    def stream_while_sleeping(mode: str, length: int) -> tuple[int, str | None, httpx.Response]:
        stream = _Stream(client, model, prompt, length)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slept = pool.submit(
                httpx.post, f"{server.root_url}/sleep", params={"mode": mode}, timeout=120
            )
            if mode == "wait":  # (the worker is closing meanwhile)
                for _ in range(3000):
                    if stream.tokens >= 100 or stream.done.done():
                        break
                    time.sleep(0.01)
                assert not slept.done() and not stream.done.done()
                with pytest.raises(openai.APIStatusError) as refused:
                    client.completions.create(model=model, prompt=prompt, max_tokens=2)
                assert refused.value.status_code == 503
            tokens, finish, _ = stream.result()
            return tokens, finish, slept.result()

    def is_sleeping() -> bool:
        return bool(httpx.get(f"{server.root_url}/is_sleeping", timeout=10).json()["is_sleeping"])

    try:
        tokens, finish, resp = stream_while_sleeping("abort", 2000)
        assert resp.status_code == 200, resp.text
        assert finish == "abort" and tokens < 2000, (finish, tokens)
        assert is_sleeping()
        assert httpx.post(f"{server.root_url}/wake_up", timeout=60).status_code == 200
        tokens, finish, resp = stream_while_sleeping("wait", 150)
        assert resp.status_code == 200, resp.text
        assert (tokens, finish) == (150, "length")
        assert is_sleeping()
        assert httpx.post(f"{server.root_url}/wake_up", timeout=60).status_code == 200
        want = client.completions.create(
            model=model, prompt=prompt, max_tokens=300, temperature=0.0,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip
        stream = _Stream(client, model, prompt, 300)
        resp = httpx.post(f"{server.root_url}/sleep", params={"mode": "keep"}, timeout=120)
        assert resp.status_code == 200, resp.text
        assert is_sleeping() and not stream.done.done()
        time.sleep(0.5)
        kept = stream.tokens
        time.sleep(1.0)
        assert stream.tokens == kept < 300 and not stream.done.done()
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=model, prompt=prompt, max_tokens=2)
        assert refused.value.status_code == 503
        assert httpx.post(f"{server.root_url}/wake_up", timeout=60).status_code == 200
        assert stream.result() == (300, "length", want)
        resp = httpx.post(f"{server.root_url}/sleep", params={"mode": "later"}, timeout=60)
        assert resp.status_code == 400 and "'later'" in resp.json()["error"]["message"]
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


def test_pause_holds_new_requests_until_resume(serve_launcher: Any) -> None:
    """vLLM's ``POST /pause`` / ``/resume`` / ``GET /is_paused`` (dev mode; no sleep mode
    needed): a completion sent while paused waits, accepted, until ``/resume``; the one
    streaming when the pause came is aborted (the default), finishes first (``mode=wait``,
    or vLLM's older ``wait_for_inflight_requests=true``: the pause answers after it), or
    stops where it is and goes on after (``mode=keep``); every text is that of a run never
    paused. Bad modes and flags are 400s."""
    server = serve_launcher.start(["--max-model-len", "2048"], env={"VLLM_SERVER_DEV_MODE": "1"})
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompt, other = [10 + i for i in range(20)], [300 + i for i in range(12)]

    def complete(tokens: list[int], length: int) -> str:
        return client.completions.create(
            model=model, prompt=tokens, max_tokens=length, temperature=0.0,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    def post(path: str, **params: Any) -> httpx.Response:
        return httpx.post(f"{server.root_url}/{path}", params=params, timeout=120)

    def is_paused() -> bool:
        return bool(httpx.get(f"{server.root_url}/is_paused", timeout=10).json()["is_paused"])

    want, want_other = complete(prompt, 200), complete(other, 8)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for params in (
                {}, {"mode": "wait"}, {"wait_for_inflight_requests": "1", "clear_cache": "no"},
                {"mode": "keep", "clear_cache": "false"},
            ):  # fmt: skip
                stream = _Stream(client, model, prompt, 200)
                resp = post("pause", **params)
                assert resp.status_code == 200 and resp.json() == {"status": "paused"}
                assert is_paused()
                if "wait" in str(params):  # (it answered once the stream had ended)
                    assert stream.tokens > 150, stream.tokens
                waiting = pool.submit(complete, other, 8)
                time.sleep(1.0)
                assert not waiting.done()
                if params.get("mode") == "keep":
                    kept = stream.tokens
                    assert not stream.done.done() and kept < 200
                    time.sleep(0.5)
                    assert stream.tokens == kept
                resp = post("resume")
                assert resp.status_code == 200 and resp.json() == {"status": "resumed"}
                assert not is_paused()
                assert waiting.result(60) == want_other
                tokens, finish, text = stream.result()
                if not params:
                    assert finish == "abort" and tokens < 200 and want.startswith(text)
                else:
                    assert (tokens, finish, text) == (200, "length", want), params
        for params in ({"mode": "later"}, {"clear_cache": "maybe"}):
            resp = post("pause", **params)
            assert resp.status_code == 400, resp.text
        assert not is_paused()
        resp = post("start_profile")  # (no --profiler-config here)
        assert resp.status_code == 400 and "profiling is off" in resp.json()["error"]["message"]
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


def test_start_and_stop_profile_write_a_trace_a_worker(serve_launcher: Any, tmp_path: Path) -> None:
    """vLLM's ``--profiler-config`` with ``POST /start_profile`` / ``/stop_profile``: the
    completion served between them lands in a trace of the prefill worker and one of the
    decode worker, named after each; a second stop is a 400."""
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    server = serve_launcher.start(["--profiler-config", json.dumps(profiler)])
    try:
        assert httpx.post(f"{server.root_url}/start_profile", timeout=60).status_code == 200
        resp = httpx.post(
            f"{server.base_url}/completions",
            json={"prompt": "The capital of France is", "max_tokens": 6},
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert httpx.post(f"{server.root_url}/stop_profile", timeout=120).status_code == 200
        traces = sorted(p.name.split("-")[0] for p in tmp_path.glob("*.pt.trace.json.gz"))
        assert traces == ["decode", "prefill"], traces
        resp = httpx.post(f"{server.root_url}/stop_profile", timeout=60)
        assert resp.status_code == 400 and "not running" in resp.json()["error"]["message"]
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


MIDDLEWARE = '''
class Tag:
    """Pure ASGI middleware: a header on every response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def tagged(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-tag", b"class")]
            await send(message)

        await self.app(scope, receive, tagged)


async def echo_path(request, call_next):
    response = await call_next(request)
    response.headers["x-path"] = request.url.path
    return response


NOT_MIDDLEWARE = 3
'''


def test_middleware_wraps_the_api(serve_launcher: Any, tmp_path: Path) -> None:
    """vLLM's ``--middleware``: an ASGI middleware class and an HTTP middleware function, by
    import path, wrap every route, the API key's 401s too (CORS's preflights stay outermost).
    A path that is not a middleware stops ``baton serve`` before anything starts."""
    (tmp_path / "my_middleware.py").write_text(MIDDLEWARE)
    paths = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": paths}
    server = serve_launcher.start(
        ["--middleware", "my_middleware.Tag", "--middleware", "my_middleware.echo_path"],
        api_key="k",
        env=env,
    )
    try:
        headers = {"Authorization": "Bearer k"}
        body = {"prompt": "Hi", "max_tokens": 2}
        ok = httpx.post(f"{server.base_url}/completions", json=body, headers=headers, timeout=60)
        assert ok.status_code == 200, ok.text
        refused = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
        health = httpx.get(f"{server.root_url}/health", timeout=10)
        for response, path in ((ok, "/v1/completions"), (refused, "/v1/completions"),
                               (health, "/health")):  # fmt: skip
            assert response.headers["x-tag"] == "class", response.headers
            assert response.headers["x-path"] == path
        assert refused.status_code == 401
        preflight = httpx.options(
            f"{server.base_url}/completions",
            headers={"Origin": "https://a.example", "Access-Control-Request-Method": "POST"},
            timeout=10,
        )
        assert preflight.status_code == 200 and "x-tag" not in preflight.headers
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"
    for bad, message in (
        ("my_middleware.NOT_MIDDLEWARE", "must be a class .* or an async function"),
        ("my_middleware.missing", "cannot be imported"),
        ("nowhere", "not an import path"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "baton.cli", "serve", "--middleware", bad],
            capture_output=True, text=True, timeout=120, env={**os.environ, **env},
        )  # fmt: skip
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert re.search(message, proc.stderr), proc.stderr

"""``baton serve`` as a process tree: it serves, and it leaves nothing behind when it ends."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
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


def test_sleep_aborts_or_waits_for_the_requests_in_flight(serve_launcher: Any) -> None:
    """``POST /sleep`` while a completion streams: by default (vLLM's ``mode=abort``) it ends at
    once with finish reason "abort" and the workers sleep; with ``mode=wait`` it runs to its
    length first (the sleep answers after), and a request sent meanwhile gets a 503. ``mode=keep``
    is a 400."""
    server = serve_launcher.start(
        ["--enable-sleep-mode", "--max-model-len", "2048"], env={"VLLM_SERVER_DEV_MODE": "1"}
    )
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    prompt = [10 + i for i in range(20)]

    def stream_while_sleeping(mode: str, length: int) -> tuple[int, str | None, httpx.Response]:
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=length, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        next(chunks)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slept = pool.submit(
                httpx.post, f"{server.root_url}/sleep", params={"mode": mode}, timeout=120
            )
            finish, tokens = None, 0
            for n, chunk in enumerate(chunks):
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if mode == "wait" and n == 100:  # (the worker is closing meanwhile)
                    with pytest.raises(openai.APIStatusError) as refused:
                        client.completions.create(model=model, prompt=prompt, max_tokens=2)
                    assert refused.value.status_code == 503
            return tokens, finish, slept.result()

    try:
        tokens, finish, resp = stream_while_sleeping("abort", 2000)
        assert resp.status_code == 200, resp.text
        assert finish == "abort" and tokens < 2000, (finish, tokens)
        assert httpx.get(f"{server.root_url}/is_sleeping", timeout=10).json()["is_sleeping"]
        assert httpx.post(f"{server.root_url}/wake_up", timeout=60).status_code == 200
        tokens, finish, resp = stream_while_sleeping("wait", 150)
        assert resp.status_code == 200, resp.text
        assert (tokens, finish) == (150, "length")
        assert httpx.get(f"{server.root_url}/is_sleeping", timeout=10).json()["is_sleeping"]
        assert httpx.post(f"{server.root_url}/wake_up", timeout=60).status_code == 200
        resp = httpx.post(f"{server.root_url}/sleep", params={"mode": "keep"}, timeout=60)
        assert resp.status_code == 400 and "keep" in resp.json()["error"]["message"]
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"

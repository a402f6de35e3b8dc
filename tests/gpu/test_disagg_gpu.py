"""Disaggregated serving on GPUs: ``baton serve --device cuda`` with the prefill worker on GPU 0
and the decode worker on GPU 1 (both on GPU 0 with a single GPU), the KV moving between their
pools in GPU memory over NIXL, gives the same greedy tokens as the aggregated stack.

The model is the default one, or, where its GGUF is not installed (GPU hosts reached through the
device tool), the folder named by ``BATON_TEST_MODEL`` served with random weights
(``benchmarks/make_model_dir.py`` makes one). Requests go one at a time so that every forward
pass has the same shape in both stacks; workers run float32.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from ports import free_port
from tiny_models import build_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

_DISAGGREGATED = ("--kv-transfer", "nixl", "--remote-prefill-threshold", "0")
_SERVING = re.compile(r"Baton is serving (\S+) at (http://\S+)/v1")
_READY_TIMEOUT_S = 300.0


def _model_argv() -> list[str]:
    """The model's arguments; skips where neither the default model nor BATON_TEST_MODEL is
    there."""
    from baton_engine.errors import ModelLoadError
    from baton_engine.model_files import default_model_path

    folder = os.environ.get("BATON_TEST_MODEL")
    if folder:
        return [folder, "--load-format", "dummy"]
    try:
        default_model_path()
    except ModelLoadError as e:
        pytest.skip(f"{e}; or set BATON_TEST_MODEL (benchmarks/make_model_dir.py makes one)")
    return []


def _gpus() -> str:
    return "0,1" if torch.cuda.device_count() >= 2 else "0"


@contextlib.contextmanager
def _serve(
    log: Path, *args: str, model_argv: list[str] | None = None
) -> Iterator[tuple[str, str, int]]:
    """Run ``baton serve`` on the GPUs; yield (model id, base URL, its pid); stop it (SIGTERM,
    wait)."""
    model_argv = _model_argv() if model_argv is None else model_argv
    cmd = [
        sys.executable, "-m", "baton.cli", "serve", *model_argv, "--port", str(free_port()),
        "--device", "cuda", "--gpus", _gpus(), "--dtype", "float32", "--max-model-len", "1024",
        "--gpu-memory-utilization", "0.4", "--disable-uvicorn-access-log", *args,
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while not (m := _SERVING.search(log.read_text(errors="replace"))):
            assert proc.poll() is None, f"baton serve exited:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"not serving:\n{log.read_text()[-4000:]}"
            time.sleep(0.5)
        yield m.group(1), m.group(2), proc.pid
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _complete(model: str, base: str, prompts: list[list[int]]) -> list[str]:
    texts = []
    for prompt in prompts:
        r = httpx.post(
            f"{base}/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": 12,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def _pulled_blocks(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("baton:kv_transfer_blocks_total{") and 'role="decode"' in line
    )


def test_disaggregated_equals_aggregated_on_gpus(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (40, 100, 300, 17)]
    with _serve(tmp_path / "aggregated.log", "--mode", "aggregated") as (model, base, _):
        want = _complete(model, base, prompts)
    with _serve(tmp_path / "disaggregated.log", *_DISAGGREGATED) as (model, base, _):
        got = _complete(model, base, prompts)
        pulled = _pulled_blocks(base)
    assert got == want
    assert pulled >= sum(n // 16 for n in (40, 100, 300, 17)), "the KV was not pulled"


def _service_pid(serve_pid: int, kind: str) -> int:
    """The pid of ``baton serve``'s child running ``baton.cli KIND``."""
    for p in psutil.Process(serve_pid).children(recursive=True):
        cmd = p.cmdline()
        if "baton.cli" in cmd and kind in cmd:
            return int(p.pid)
    raise AssertionError(f"no {kind} process under baton serve")


def test_prefill_worker_killed_on_gpus_costs_no_request(tmp_path: Path) -> None:
    """SIGKILL to the prefill worker while requests keep coming: each one still completes with
    the aggregated stack's tokens (the gateway prefills on the decode worker meanwhile, and
    ``baton serve`` restarts the prefill worker)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g).tolist()
               for n in torch.randint(200, 600, (24,), generator=g)]  # fmt: skip
    with _serve(tmp_path / "aggregated.log", "--mode", "aggregated") as (model, base, _):
        want = _complete(model, base, prompts)
    log = tmp_path / "disaggregated.log"
    with _serve(log, *_DISAGGREGATED) as (model, base, serve_pid):
        assert _complete(model, base, prompts[:2]) == want[:2]
        assert _pulled_blocks(base) > 0, "the KV was not pulled"
        prefill = _service_pid(serve_pid, "prefill")
        # One request at a time (every forward pass shaped as in the aggregated run), the kill
        # landing while they run.
        killer = threading.Timer(0.2, os.kill, (prefill, signal.SIGKILL))
        killer.start()
        try:
            got = _complete(model, base, prompts[2:])
        finally:
            killer.cancel()
        assert not psutil.pid_exists(prefill) or psutil.Process(prefill).status() == "zombie"
        assert "prefill exited with status" in log.read_text(errors="replace")
    assert got == want[2:]


_TP_PROMPT_LENS = (40, 100, 300, 17)
# A tiny Llama of real (seeded) weights: random dummy weights are drawn per shard, so a split
# model's would differ from the whole one's.
_TP_SERVE = ("--max-model-len", "512", "--num-gpu-blocks-override", "2048")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> str:
    folder = os.environ.get("BATON_TEST_MODEL")
    tokenizer_dir = Path(folder) if folder else request.getfixturevalue("default_model_dir")
    out = tmp_path_factory.mktemp("tiny-llama")
    build_model("llama", tokenizer_dir, out)
    return str(out)


@pytest.fixture(scope="module")
def aggregated_texts(tiny_llama: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The aggregated stack's greedy texts for ``_tp_prompts()`` (one rank, GPU 0)."""
    log = tmp_path_factory.mktemp("aggregated") / "serve.log"
    args = ("--mode", "aggregated", "--gpus", "0", *_TP_SERVE)
    with _serve(log, *args, model_argv=[tiny_llama]) as (model, base, _):
        return _complete(model, base, _tp_prompts())


def _tp_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in _TP_PROMPT_LENS]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "tp_args",
    [
        ("-tp", "2"),
        ("--prefill-tensor-parallel-size", "2", "-tp", "1"),
        ("--prefill-tensor-parallel-size", "1", "-tp", "2"),
    ],
    ids=["2to2", "2to1", "1to2"],
)
def test_tensor_parallel_disaggregation_on_gpus(
    tp_args: tuple[str, ...], tiny_llama: str, aggregated_texts: list[str], tmp_path: Path
) -> None:
    """Prefill and decode workers split across the two GPUs (sharing them: a fixed KV pool
    each), KV over NIXL as whole blocks: a split prefill worker gathers its ranks' heads over
    NCCL, a split decode worker broadcasts them to its ranks. The greedy texts equal the
    aggregated stack's of one rank."""
    args = (*_DISAGGREGATED, "--mode", "disaggregated", *tp_args, *_TP_SERVE)
    with _serve(tmp_path / "serve.log", *args, model_argv=[tiny_llama]) as (model, base, _):
        got = _complete(model, base, _tp_prompts())
        pulled = _pulled_blocks(base)
    assert got == aggregated_texts
    assert pulled >= sum(n // 16 for n in _TP_PROMPT_LENS), "the KV was not pulled"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_dead_helper_rank_on_gpus_restarts_its_worker(
    tiny_llama: str, aggregated_texts: list[str], tmp_path: Path
) -> None:
    """The decode worker's helper rank (GPU 1) killed: the worker exits with status 1 at once,
    ``baton serve`` restarts it on both GPUs, and it answers with the one-rank texts again."""
    log = tmp_path / "serve.log"
    args = ("--mode", "aggregated", "-tp", "2", *_TP_SERVE)
    with _serve(log, *args, model_argv=[tiny_llama]) as (model, base, serve_pid):
        decode = psutil.Process(_service_pid(serve_pid, "decode"))
        (helper,) = [p for p in decode.children(recursive=True)
                     if any("spawn_main" in a for a in p.cmdline())]  # fmt: skip
        helper.kill()
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while "decode exited with status 1" not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2}
        while httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code != 200:
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)  # the restarted worker is still loading
        got = _complete(model, base, _tp_prompts())
        assert _service_pid(serve_pid, "decode") != decode.pid
    assert got == aggregated_texts

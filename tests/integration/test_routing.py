"""KV-aware routing: with two decode workers found through the kvstore, requests sharing a prefix
land on the worker that caches it, and the gateway counts its decisions."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from procs import ENGINE_ARGS, Service, launch, launch_disaggregated, stop, wait_all

pytestmark = pytest.mark.integration


def finished(worker: Service) -> float:
    return worker.metrics().get("baton:request_success_total", 0.0)


def test_requests_sharing_a_prefix_land_on_the_worker_caching_it() -> None:
    services: list[Service] = []
    try:
        kvstore = launch("kvstore", ["--port", "0"])
        services.append(kvstore)
        wait_all(services)
        workers = [
            launch(
                "decode",
                ["--port", "0", "--worker-id", f"d{i}", "--kvstore", kvstore.address, *ENGINE_ARGS],
            )
            for i in range(2)
        ]
        services += workers
        wait_all(services)
        gateway = launch("gateway", ["--port", "0", "--kvstore", kvstore.address])
        services.append(gateway)
        wait_all(services)

        def complete(prompt: str) -> None:
            r = httpx.post(
                f"{gateway.address}/v1/completions",
                json={"prompt": prompt, "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200, r.text

        for topic in ("the history of clocks", "growing tomatoes on a balcony"):
            prefix = f"A long shared preamble about {topic}. " * 20
            before = [finished(w) for w in workers]
            complete(prefix + "First question?")
            first = [finished(w) - b for w, b in zip(workers, before, strict=True)]
            owner = first.index(1.0)
            time.sleep(1.0)  # the owner's KV events reach the kvstore's index
            for i in range(4):
                complete(prefix + f"Follow-up number {i}?")
            after = [finished(w) - b for w, b in zip(workers, before, strict=True)]
            assert after[owner] == 5 and after[1 - owner] == 0, (topic, after)

        text = httpx.get(gateway.metrics_url, timeout=5).text
        decisions = [
            line for line in text.splitlines() if line.startswith("baton:disagg_decisions")
        ]
        # Short prompts (under --remote-prefill-threshold): every one was prefilled locally.
        assert any(
            line.startswith('baton:disagg_decisions_total{decision="local_cached"')
            and line.endswith(" 10.0")
            for line in decisions
        ), decisions
    finally:
        stop(reversed(services))


def test_a_busy_prefill_worker_sheds_prompts_to_the_decode_worker() -> None:
    """With ``--max-remote-prefill-wait-ms``, prompts that would queue behind others on the
    prefill worker are prefilled on the decode worker while its own queue is shorter, and they
    generate what they generate when prefilled remotely."""
    services: list[Service] = []
    try:
        gateway = launch_disaggregated(services, gateway_args=["--max-remote-prefill-wait-ms", "0"])
        prompts = [[100 + 7 * i + j for j in range(300)] for i in range(6)]

        def complete(prompt: list[int]) -> str:
            return greedy_completion(gateway, prompt, 8)

        # One at a time: the prefill worker's queue is empty, so every prompt goes there (and
        # the gateway learns its speed).
        alone = [complete(p) for p in prompts]
        assert decisions(gateway) == {"remote": 6.0}
        # All at once: every other prompt would wait behind the one before it.
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(complete, prompts))
        assert together == alone
        counts = decisions(gateway)
        assert counts.get("local_prefill_queue", 0) >= 1, counts
        assert counts["remote"] >= 7, counts
    finally:
        stop(reversed(services))


def greedy_completion(gateway: Service, prompt: list[int], max_tokens: int) -> str:
    r = httpx.post(
        f"{gateway.address}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def decisions(gateway: Service) -> dict[str, float]:
    """The gateway's ``baton:disagg_decisions_total`` by decision."""
    text = httpx.get(gateway.metrics_url, timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if m := re.match(r'baton:disagg_decisions_total\{.*decision="([^"]+)".*\} (\S+)$', line):
            out[m.group(1)] = float(m.group(2))
    return out


def test_a_prefix_in_the_decode_workers_host_tier_is_prefilled_there() -> None:
    """--kv-offloading-size on the workers: a conversation whose prompt the decode worker's
    pool evicted into its host tier is still that worker's in the kvstore's index, so the
    gateway prefills its next turn there from the tier instead of sending the whole prompt to
    the prefill worker."""
    services: list[Service] = []
    try:
        kvstore = launch("kvstore", ["--port", "0"])
        services.append(kvstore)
        wait_all(services)
        # ENGINE_ARGS' pool holds 91 blocks: one of the 50-block prompts below, not two
        worker_args = ["--port", "0", "--kvstore", kvstore.address, "--kv-offloading-size", "0.1"]
        workers = [launch(kind, [*worker_args, *ENGINE_ARGS]) for kind in ("prefill", "decode")]
        services += workers
        wait_all(services)
        decode = workers[1]
        gateway = launch(
            "gateway",
            ["--port", "0", "--kvstore", kvstore.address, "--remote-prefill-threshold", "64"],
        )
        services.append(gateway)
        wait_all(services)

        def complete(prompt: list[int]) -> None:
            greedy_completion(gateway, prompt, 2)

        first, second = ([base + j % 97 for j in range(800)] for base in (100, 300))
        complete([*first, 5])
        complete([*second, 5])  # its blocks push most of first's out of the decode pool
        assert decisions(gateway) == {"remote": 2.0}
        time.sleep(1.0)  # the workers' KV events reach the kvstore's index
        complete([*first, 6])
        assert decisions(gateway) == {"remote": 2.0, "local_cached": 1.0}
        metrics = decode.metrics()
        # second's 51 blocks took the pool's 40 never used and 11 of first's (its tail first):
        # its 10 full ones came back from the tier
        assert metrics["baton:external_prefix_cache_hits_total"] == 160, metrics
    finally:
        stop(reversed(services))


def test_a_negative_prefill_wait_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "baton.cli", "gateway", "--max-remote-prefill-wait-ms", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--max-remote-prefill-wait-ms must be at least 0" in proc.stdout + proc.stderr

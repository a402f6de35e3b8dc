"""``baton bench serve`` against a real ``baton serve`` (the session's shared server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

BENCH_TIMEOUT_S = 300.0


def bench(server: Any, *extra: str, api_key: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``baton bench serve`` against ``server`` (a conftest.ServeProcess)."""
    cmd = [sys.executable, "-m", "baton.cli", "bench", "serve", "--base-url", server.root_url]
    cmd += ["--disable-tqdm", *extra]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S, env=env)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_tiny_workload(baton_server: Any, tmp_path: Path, endpoint: str) -> None:
    proc = bench(
        baton_server,
        "--endpoint", endpoint,
        "--num-prompts", "8",
        "--random-input-len", "16",
        "--random-output-len", "8",
        "--max-concurrency", "4",
        "--ignore-eos",
        "--goodput", "ttft:60000", "tpot:60000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "result.json",
        "--plot-cdf", str(tmp_path / "cdf.png"),
        api_key=baton_server.api_key,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "============ Serving Benchmark Result ============" in proc.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["model_id"] == baton_server.model  # discovered through /v1/models
    assert result["completed"] == 8 and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == 64 and result["output_lens"] == [8] * 8
    assert result["total_input_tokens"] == 8 * 16
    assert all(t > 0 for t in result["ttfts"]) and result["mean_ttft_ms"] > 0
    # One gap per text chunk after the first: 7 for 8 tokens, fewer when the server holds text
    # back (a character split across tokens is sent whole) and sends several tokens at once.
    assert all(1 <= len(itl) <= 7 and min(itl) >= 0 for itl in result["itls"])
    assert result["mean_itl_ms"] > 0 and result["p99_itl_ms"] > 0 and result["mean_tpot_ms"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["output_throughput"] > 0
    assert (tmp_path / "cdf.png").stat().st_size > 0


def test_bench_serve_stops_when_the_initial_request_fails(baton_server: Any) -> None:
    # The shared server requires an API key: without it every request is refused with 401.
    proc = bench(baton_server, "--model", baton_server.model, "--num-prompts", "2", api_key=None)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "initial test request failed" in proc.stderr and "HTTP 401" in proc.stderr

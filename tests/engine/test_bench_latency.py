"""``baton bench latency`` on the real engine: one request at a time, prefill and decode timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_latency_reports_prefill_and_decode(tmp_path: Path) -> None:
    out = tmp_path / "latency.json"
    cmd = [
        sys.executable, "-m", "baton.cli", "bench", "latency", "--input-len", "32",
        "--output-len", "6", "--num-iters", "2", "--num-iters-warmup", "1",
        "--max-model-len", "256", "--kv-cache-memory", str(64 << 20), "--output-json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["input_len"] == 32 and result["num_iters"] == 2
    assert len(result["latencies"]) == 2 and len(result["prefill_times"]) == 2
    # per iteration, one time per decode step: the first token comes from the prefill step
    assert [len(steps) for steps in result["decode_times"]] == [5, 5]
    assert 0 < result["mean_prefill_ms"] < result["mean_e2el_ms"]
    assert 0 < result["mean_decode_ms"] < result["mean_e2el_ms"]
    assert "Decode per token (batch 1)" in proc.stdout

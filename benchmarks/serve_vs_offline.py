"""Serving cost: ``baton bench serve`` against ``baton serve`` vs the offline engine, same run.

    python benchmarks/serve_vs_offline.py [--num-prompts 64] [--input-len 128] [--output-len 128]
        [--max-concurrency 16] [--dtype bfloat16]
        [--serve-args '--mode aggregated']

Runs the offline throughput benchmark (``baton bench throughput --no-hf``) on the workload (all
requests at once, and again with ``--max-num-seqs`` equal to the serving concurrency), then
starts ``baton serve`` on a free loopback port, runs ``baton bench serve`` with the same workload
(streaming, ``ignore_eos``, fixed concurrency), stops the server and prints both figures and
their ratio. The issue's bar: serving throughput >= 80% of offline.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATON = [sys.executable, "-m", "baton.cli"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def offline(args: argparse.Namespace, out: Path, max_num_seqs: int = 256) -> float:
    cmd = [*BATON, "bench", "throughput", "--no-hf", "--dtype", args.dtype,
           "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--output-json", str(out),
           "--max-num-seqs", str(max_num_seqs)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["results"]["baton"])


def served(args: argparse.Namespace, out_dir: Path) -> dict[str, float]:
    port = free_port()
    server = subprocess.Popen(
        [*BATON, "serve", "--port", str(port), "--dtype", args.dtype, *args.serve_args.split()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        assert server.stdout is not None
        for line in server.stdout:
            if re.search(r"serving .* at http", line):
                break
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("baton serve did not come up")
        cmd = [*BATON, "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
               "--num-prompts", str(args.num_prompts),
               "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len),
               "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", "serve.json",
               "--disable-tqdm"]  # fmt: skip
        subprocess.run(cmd, check=True)
        return dict(json.loads((out_dir / "serve.json").read_text()))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--serve-args", default="", help="extra `baton serve` flags, e.g. --mode aggregated"
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        offline_tps = offline(args, Path(tmp) / "offline.json")
        offline_same_tps = offline(args, Path(tmp) / "offline16.json", args.max_concurrency)
        result = served(args, Path(tmp))
    serve_tps = float(result["output_throughput"])
    print(f"\n{'offline engine (all submitted at once)':<44} {offline_tps:>8.1f} output tok/s")
    served_name = f"served, concurrency {args.max_concurrency}"
    print(f"{served_name:<44} {serve_tps:>8.1f} output tok/s")
    same_name = f"offline engine, max_num_seqs {args.max_concurrency}"
    print(f"{same_name:<44} {offline_same_tps:>8.1f} output tok/s")
    print(f"{'served / offline (all at once)':<44} {serve_tps / offline_tps:>8.2f}")
    print(f"{'served / offline (same concurrency)':<44} {serve_tps / offline_same_tps:>8.2f}")
    print(
        f"mean TTFT {result['mean_ttft_ms']:.0f} ms, median TTFT {result['median_ttft_ms']:.0f} "
        f"ms, mean ITL {result['mean_itl_ms']:.1f} ms, mean TPOT {result['mean_tpot_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

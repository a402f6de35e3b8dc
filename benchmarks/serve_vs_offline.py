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
import resource
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


def cpu_seconds_by_process(root: int) -> dict[str, float]:
    """User + system CPU seconds of ``root`` and every process below it, by command line."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float, str]] = {}  # pid -> (parent, cpu seconds, name)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        name = " ".join(a.decode() for a in argv[1:4] if a) or entry.name  # "-m baton.cli decode"
        secs = (int(fields[11]) + int(fields[12])) / tick
        stats[int(entry.name)] = (int(fields[1]), secs, f"{name} ({entry.name})")
    out: dict[str, float] = {}
    for pid, (_, secs, name) in stats.items():
        p = pid
        while p in stats and p != root:
            p = stats[p][0]
        if p == root:
            out[name] = secs
    return out


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
        before = cpu_seconds_by_process(server.pid)
        client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        subprocess.run(cmd, check=True)
        wall = time.monotonic() - start
        client = resource.getrusage(resource.RUSAGE_CHILDREN)
        after = cpu_seconds_by_process(server.pid)
        print(f"\nCPU use during the served run ({wall:.1f} s), in cores:")
        for name, secs in sorted(after.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<60} {(secs - before.get(name, 0.0)) / wall:5.2f}")
        client_secs = (client.ru_utime + client.ru_stime) - (
            client_before.ru_utime + client_before.ru_stime
        )
        print(f"  {'baton bench serve (the client)':<60} {client_secs / wall:5.2f}")
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
    p.add_argument("--served-only", action="store_true", help="skip the offline runs (diagnostics)")
    args = p.parse_args()
    if args.served_only:
        with tempfile.TemporaryDirectory() as tmp:
            result = served(args, Path(tmp))
        print(f"served: {result['output_throughput']:.1f} output tok/s")
        return 0
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

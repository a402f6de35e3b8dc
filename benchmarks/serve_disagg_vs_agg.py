"""TTFT and ITL, disaggregated versus aggregated serving, on a mix of long prompts and short chats.

    python benchmarks/serve_disagg_vs_agg.py [--modes aggregated,nixl,grpc,nixl+omp1]
        [--num-alone 2] [--num-long 4] [--num-short 12] [--long-len 2000] [--short-len 50]
        [--output-len 64] [--max-concurrency 4] [--quiet-cores 0.2] [--log-dir DIR]
        [--output-json PATH]

In one run, for each mode in turn: starts ``baton serve`` on a free loopback port
(``aggregated``: ``--mode aggregated``, decode worker + gateway; ``nixl`` / ``grpc``: the default
disaggregated stack, kvstore + prefill worker + decode worker + gateway, with that
``--kv-transfer``; ``+ompN`` sets OMP_NUM_THREADS=N for the whole stack), waits for "Baton is
serving", sends two warm-up requests (one long, one short, prompts of their own: the first pull
pays the transfer handshake), runs the timed phases with ``baton bench serve``'s load generator
(streamed ``/v1/completions``, ``ignore_eos``), scraping the gateway's ``/metrics`` before and
after each, and stops the stack (SIGTERM to ``baton serve``, wait).

Phases, the same prompts in every mode (random tokens, seeded, no two sharing a prefix):
- alone: ``--num-alone`` long prompts, then as many short ones, one at a time. A long prompt's
  TTFT here is its prefill with nothing else running: the clean test of the claim that a
  disaggregated TTFT exceeds the aggregated one by at most the KV transfer time.
- mixed: ``--num-long`` prompts of ``--long-len`` tokens spread evenly among ``--num-short``
  prompts of ``--short-len`` tokens, at ``--max-concurrency`` (a closed loop: a finished request
  lets the next one in, so a faster mode also changes when the long prompts arrive).
With the default ``--remote-prefill-threshold`` (256) long prompts are prefilled on the prefill
worker and short ones locally on the decode worker.

Prints one row per mode, phase and prompt class (TTFT and ITL mean / p50 / p99; "ITL≥2nd": ITL
without each request's first gap; "1st gap": first to second token, which in disaggregated mode
holds the KV pull), then per run the decode worker's KV transfer time from
``baton:kv_transfer_seconds``, the gateway's routing decisions (``baton:disagg_decisions_total``),
the load average and the cores this stack and all other processes kept busy, then the TTFT of
each long prompt side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from baton.bench.client import RequestConfig
from baton.bench.datasets import SampleRequest, load_bench_tokenizer, random_requests
from baton.bench.metrics import BenchmarkMetrics, RequestResult, calculate_metrics, summarize
from baton.bench.runner import LoadShape, RunState, run_benchmark
from baton.bench.serve import discover_model

BATON = [sys.executable, "-m", "baton.cli"]
_READY = re.compile(r"Baton is serving .* at http")
_WORKER_READY = re.compile(r"baton (prefill|decode) ready on (\S+)")
_PERCENTILES = (50.0, 99.0)

MetricKey = tuple[str, tuple[tuple[str, str], ...]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ModeResult:
    mode: str
    phase: str
    results: list[RequestResult]
    duration: float
    metrics_delta: dict[MetricKey, float]
    roles: dict[str, str]  # worker address -> "prefill" | "decode"
    loadavg: tuple[float, float]  # 1-minute load average before and after the timed run
    cores: tuple[float, float]  # cores busy on average in the timed run: this stack, the others
    t0: float  # perf_counter when the phase's first request was sent
    overall: BenchmarkMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.overall = calculate_metrics(self.results, self.duration, _PERCENTILES)


@dataclass
class Phase:
    name: str  # "alone" | "mixed"
    samples: list[SampleRequest]
    concurrency: int


# --- the workload -------------------------------------------------------------------------------


def build_workload(args: argparse.Namespace) -> tuple[list[Phase], list[SampleRequest]]:
    """(timed phases, warm-up samples), each prompt drawn with its own seed (no shared prefix).

    Phase "alone": ``--num-alone`` long prompts then as many short ones, one at a time. Phase
    "mixed": the long prompts spread evenly among the short ones, at ``--max-concurrency``.
    """
    tokenizer = load_bench_tokenizer(args.model)
    out, seed = args.output_len, args.seed

    def draw(num: int, length: int, seed: int, out: int = out) -> list[SampleRequest]:
        return random_requests(tokenizer, num, length, out, seed=seed) if num > 0 else []

    longs = draw(args.num_long, args.long_len, seed)
    shorts = draw(args.num_short, args.short_len, seed + 1)
    total = len(longs) + len(shorts)
    long_at = {i * total // len(longs) for i in range(len(longs))} if longs else set()
    mixed: list[SampleRequest] = []
    li, si = iter(longs), iter(shorts)
    for i in range(total):
        mixed.append(next(li) if i in long_at else next(si))
    alone = [*draw(args.num_alone, args.long_len, seed + 2),
             *draw(args.num_alone, args.short_len, seed + 3)]  # fmt: skip
    warm = [*draw(1, args.long_len, seed + 100, 8), *draw(1, args.short_len, seed + 101, 8)]
    return [Phase("alone", alone, 1), Phase("mixed", mixed, args.max_concurrency)], warm


def is_long(result: RequestResult, args: argparse.Namespace) -> bool:
    return bool(result.prompt_len > args.remote_prefill_threshold)


# --- one stack ------------------------------------------------------------------------------------


def scrape(base: str) -> tuple[str, dict[MetricKey, float]]:
    text = httpx.get(f"{base}/metrics", timeout=30.0).text
    values: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return text, values


@dataclass(frozen=True)
class Mode:
    base: str  # "aggregated" | "nixl" | "grpc"
    env: dict[str, str]  # OpenMP settings for every process of the stack
    num_decode: int  # decode workers
    prefill_wait_ms: float | None = None  # --max-remote-prefill-wait-ms


def parse_mode(mode: str) -> Mode:
    """``"nixl+omp1"`` -> the nixl stack with OMP_NUM_THREADS=1 (in every process: ``baton
    serve`` then splits no cores); ``"nixl+passive"`` -> with OMP_WAIT_POLICY=PASSIVE (idle
    OpenMP threads sleep instead of spinning); ``"nixl+spin1000"`` -> with GOMP_SPINCOUNT=1000
    (they spin that long first); ``"aggregated+dec2"`` -> two aggregated decode
    workers (replicas behind the gateway); ``"nixl+wait300"`` -> the nixl stack prefilling on
    the decode worker what would wait over 300 ms for the prefill worker."""
    base, *opts = mode.split("+")
    env: dict[str, str] = {}
    num_decode, wait_ms = 1, None
    for opt in opts:
        if m := re.fullmatch(r"omp(\d+)", opt):
            env["OMP_NUM_THREADS"] = m.group(1)
        elif opt == "passive":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        elif m := re.fullmatch(r"spin(\d+)", opt):
            env["GOMP_SPINCOUNT"] = m.group(1)
        elif m := re.fullmatch(r"dec(\d+)", opt):
            num_decode = int(m.group(1))
        elif m := re.fullmatch(r"wait(\d+)", opt):
            wait_ms = float(m.group(1))
        else:
            raise ValueError(f"unknown option {opt!r} in mode {mode!r}")
    if base not in ("aggregated", "nixl", "grpc"):
        raise ValueError(f"unknown mode {mode!r}")
    return Mode(base, env, num_decode, wait_ms)


def parse_modes(p: argparse.ArgumentParser, text: str) -> list[str]:
    """The comma-separated modes of ``text``, each checked (``p.error`` on a bad one)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            p.error(str(e))
    return modes


def write_summary(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """``summary`` with the arguments, as JSON to ``args.output_json`` (if set)."""
    if args.output_json is not None:
        summary["args"] = {k: str(v) for k, v in vars(args).items()}
        args.output_json.write_text(json.dumps(summary, indent=2))


def start_stack(mode: str, args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen[str]:
    m = parse_mode(mode)
    cmd = [*BATON, "serve", *([args.model] if args.model else []), "--port", str(port),
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--disable-uvicorn-access-log", "--num-decode", str(m.num_decode),
           "--remote-prefill-threshold", str(args.remote_prefill_threshold),
           *shlex.split(args.serve_args)]  # fmt: skip
    if m.base == "aggregated":
        cmd += ["--mode", "aggregated"]
    else:
        cmd += ["--kv-transfer", m.base]
    if m.prefill_wait_ms is not None:
        cmd += ["--max-remote-prefill-wait-ms", str(m.prefill_wait_ms)]
    env = {**os.environ, **m.env}
    prefix = "".join(f"{k}={v} " for k, v in m.env.items())
    print(f"[{mode}] {prefix}baton {' '.join(cmd[3:])}  (log: {log})", flush=True)
    with log.open("w") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
        )


def wait_ready(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> dict[str, str]:
    """Wait for "Baton is serving"; return the workers' addresses -> roles from the log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if _READY.search(text):
            return {addr: role for role, addr in _WORKER_READY.findall(text)}
        if proc.poll() is not None:
            raise SystemExit(f"baton serve exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.5)
    raise SystemExit(f"baton serve not ready after {timeout_s:.0f} s; see {log}")


def stop_stack(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM to ``baton serve`` (it stops its children in order) or any server started in its
    own session, then wait; SIGKILL after 90 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _busy_jiffies() -> int:
    """CPU time all processes of the machine spent (user + nice + system + irq + softirq)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return user + nice + system + irq + softirq


def _my_jiffies() -> int:
    """CPU time (user + system) of this process and all its live descendants (the stack)."""
    ppid: dict[int, int] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid[int(entry)] = int(rest[1])
        times[int(entry)] = int(rest[11]) + int(rest[12])
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        parent = frontier.pop()
        for pid, pp in ppid.items():
            if pp == parent and pid not in mine:
                mine.add(pid)
                frontier.append(pid)
    return sum(times.get(pid, 0) for pid in mine)


def others_busy(window_s: float = 3.0) -> float:
    """Cores kept busy by processes other than this one and its descendants, over a window."""
    busy0, mine0 = _busy_jiffies(), _my_jiffies()
    time.sleep(window_s)
    busy1, mine1 = _busy_jiffies(), _my_jiffies()
    return max(0, (busy1 - busy0) - (mine1 - mine0)) / os.sysconf("SC_CLK_TCK") / window_s


def wait_quiet(max_cores: float, max_wait_s: float) -> None:
    """Wait (at most ``max_wait_s``) until other processes keep fewer than ``max_cores`` busy."""
    deadline = time.monotonic() + max_wait_s
    while (busy := others_busy()) >= max_cores and time.monotonic() < deadline:
        time.sleep(2)
    print(
        f"  other processes busy: {busy:.2f} cores; load avg {os.getloadavg()[0]:.2f}", flush=True
    )


async def _send(cfg: RequestConfig, samples: Sequence[SampleRequest], conc: int) -> RunState:
    state = RunState(results=[None] * len(samples))
    shape = LoadShape(max_concurrency=conc, initial_test=False, show_progress=False)
    await run_benchmark(cfg, samples, shape, state)
    return state


def timed_phase(
    mode: str,
    args: argparse.Namespace,
    base: str,
    cfg: RequestConfig,
    phase: Phase,
    roles: dict[str, str],
    log_dir: Path,
) -> ModeResult:
    """Run one phase against a serving stack, with /metrics scraped before and after."""
    if args.quiet_cores > 0:
        wait_quiet(args.quiet_cores, args.quiet_wait)
    _, before = scrape(base)
    load_before = os.getloadavg()[0]
    busy0, mine0 = _busy_jiffies(), _my_jiffies()
    state = asyncio.run(_send(cfg, phase.samples, phase.concurrency))
    busy1, mine1 = _busy_jiffies(), _my_jiffies()
    load_after = os.getloadavg()[0]
    text, after = scrape(base)
    (log_dir / f"metrics-{mode.replace('+', '-')}-{phase.name}.txt").write_text(text)
    assert state.start is not None and state.end is not None
    results = [r for r in state.results if r is not None]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    hz = os.sysconf("SC_CLK_TCK")
    duration = state.end - state.start
    mine, others = mine1 - mine0, max(0, (busy1 - busy0) - (mine1 - mine0))
    cores = (mine / hz / duration, others / hz / duration)
    loadavg = (load_before, load_after)
    return ModeResult(
        mode, phase.name, results, duration, delta, roles, loadavg, cores, state.start
    )


@contextlib.contextmanager
def running_stack(
    mode: str,
    args: argparse.Namespace,
    log_dir: Path,
    warm_up: Callable[[RequestConfig], RunState],
    timeout_s: float = 600.0,
) -> Iterator[tuple[str, RequestConfig, dict[str, str]]]:
    """Start the stack of ``mode``, wait until it serves, run ``warm_up`` (each of its requests
    must succeed); yield (base URL, request config, worker roles); stop the stack."""
    port = free_port()
    log = log_dir / f"serve-{mode.replace('+', '-')}.log"
    proc = start_stack(mode, args, port, log)
    try:
        roles = wait_ready(proc, log, args.ready_timeout)
        base = f"http://127.0.0.1:{port}"
        cfg = RequestConfig(
            url=base + "/v1/completions",
            model=discover_model(base, None),
            chat=False,
            ignore_eos=True,
            timeout_s=timeout_s,
        )
        warm_state = warm_up(cfg)
        failed = [
            r.error if r else "no result" for r in warm_state.results if not (r and r.success)
        ]
        if failed:
            raise SystemExit(f"[{mode}] a warm-up request failed: {failed[0]}")
        yield base, cfg, roles
    finally:
        stop_stack(proc)


def run_mode(
    mode: str,
    args: argparse.Namespace,
    phases: list[Phase],
    warm: list[SampleRequest],
    log_dir: Path,
) -> list[ModeResult]:
    """Start the stack of ``mode``, warm it up, run ``phases`` in order, stop it."""

    def warm_up(cfg: RequestConfig) -> RunState:
        return asyncio.run(_send(cfg, warm, 1))

    with running_stack(mode, args, log_dir, warm_up) as (base, cfg, roles):
        return [
            timed_phase(mode, args, base, cfg, ph, roles, log_dir) for ph in phases if ph.samples
        ]


# --- the report -----------------------------------------------------------------------------------


def metric_by_labels(delta: dict[MetricKey, float], name: str, **match: str) -> dict[str, float]:
    """``name``'s samples whose labels include ``match``, by their remaining labels."""
    out: dict[str, float] = {}
    for (n, labels), v in delta.items():
        d = dict(labels)
        if n == name and all(d.get(k) == val for k, val in match.items()):
            rest = ",".join(f"{k}={val}" for k, val in labels if k not in match)
            out[rest] = out.get(rest, 0.0) + v
    return out


def kv_pull_stats(delta: dict[MetricKey, float], roles: dict[str, str]) -> dict[str, float]:
    """KV pulled by the decode worker(s) over a metrics delta: count, seconds, bytes."""
    names = {
        "count": "baton:kv_transfer_seconds_count",
        "seconds": "baton:kv_transfer_seconds_sum",
        "read_seconds": "baton:kv_transfer_read_seconds_sum",
        "bytes": "baton:kv_transfer_bytes_total",
    }
    out = dict.fromkeys(names, 0.0)
    for addr, role in roles.items():
        if role == "decode":
            for key, name in names.items():
                out[key] += sum(metric_by_labels(delta, name, worker=addr).values())
    return out


def transfer_stats(r: ModeResult) -> dict[str, float]:
    """KV pulled by the decode worker(s) during the timed run: count, seconds, bytes."""
    return kv_pull_stats(r.metrics_delta, r.roles)


def decisions(delta: dict[MetricKey, float]) -> dict[str, int]:
    """The gateway's routing decisions (``baton:disagg_decisions_total``) over a metrics delta."""
    out: dict[str, int] = {}
    for (n, labels), v in delta.items():
        if n == "baton:disagg_decisions_total" and v:
            decision = dict(labels).get("decision", "?")
            out[decision] = out.get(decision, 0) + round(v)
    return out


def class_rows(r: ModeResult, args: argparse.Namespace) -> list[dict[str, Any]]:
    ok = [x for x in r.results if x.success]
    rows = []
    for name, subset in (
        ("long", [x for x in ok if is_long(x, args)]),
        ("short", [x for x in ok if not is_long(x, args)]),
        ("all", ok),
    ):
        if not subset:
            continue
        ttft = summarize([x.ttft for x in subset], _PERCENTILES)
        itl = summarize([g for x in subset for g in x.itl], _PERCENTILES)
        # ITL after the first gap: the steady decode pace, without the KV pull of a remote
        # prefill (which sits between the first and the second token).
        itl_rest = summarize([g for x in subset for g in x.itl[1:]], _PERCENTILES)
        first_gap = summarize([x.itl[0] for x in subset if x.itl], _PERCENTILES)
        rows.append({
            "mode": r.mode, "phase": r.phase, "class": name, "requests": len(subset),
            "ttft_mean": ttft.mean, "ttft_p50": ttft.median, "ttft_p99": ttft.percentiles[99.0],
            "itl_mean": itl.mean, "itl_p50": itl.median, "itl_p99": itl.percentiles[99.0],
            "itl_rest_mean": itl_rest.mean, "first_gap_mean": first_gap.mean,
        })  # fmt: skip
    return rows


def _print_table(results: list[ModeResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    head = (f"{'mode':<15} {'phase':<5} {'class':<5} {'req':>3} {'out tok/s':>9} | "
            f"{'TTFT mean':>9} {'p50':>6} {'p99':>6} | {'ITL mean':>8} {'p50':>5} {'p99':>6} | "
            f"{'ITL≥2nd':>7} {'1st gap':>7}")  # fmt: skip
    print(head + "   (ms)")
    print("-" * len(head))
    rows: list[dict[str, Any]] = []
    for r in results:
        for row in class_rows(r, args):
            row["output_tok_s"] = r.overall.output_throughput
            rows.append(row)
            tps = f"{r.overall.output_throughput:9.1f}" if row["class"] == "all" else " " * 9
            print(f"{r.mode:<15} {r.phase:<5} {row['class']:<5} {row['requests']:>3} {tps} | "
                  f"{row['ttft_mean']:>9.0f} {row['ttft_p50']:>6.0f} {row['ttft_p99']:>6.0f} | "
                  f"{row['itl_mean']:>8.1f} {row['itl_p50']:>5.1f} {row['itl_p99']:>6.1f} | "
                  f"{row['itl_rest_mean']:>7.1f} {row['first_gap_mean']:>7.1f}")  # fmt: skip
    return rows


def report(results: list[ModeResult], args: argparse.Namespace) -> dict[str, Any]:
    print()
    print(
        f"Phase alone: {args.num_alone} x {args.long_len}-token prompts then {args.num_alone} x "
        f"{args.short_len}-token prompts, one at a time. Phase mixed: {args.num_long} x "
        f"{args.long_len}-token prompts spread among {args.num_short} x {args.short_len}-token "
        f"prompts at concurrency {args.max_concurrency}. {args.output_len} output tokens each "
        f"(ignore_eos), {args.dtype}, /v1/completions streamed."
    )
    print()
    rows = _print_table(results, args)
    print()
    summary: dict[str, Any] = {"rows": rows, "runs": []}
    for r in results:
        t = transfer_stats(r)
        d = decisions(r.metrics_delta)
        mean_ms = 1000 * t["seconds"] / t["count"] if t["count"] else 0.0
        gbps = t["bytes"] / t["seconds"] / 1e9 if t["seconds"] else 0.0
        read_ms = 1000 * t["read_seconds"] / t["count"] if t["count"] else 0.0
        read_gbps = t["bytes"] / t["read_seconds"] / 1e9 if t["read_seconds"] else 0.0
        print(
            f"{r.mode:<15} {r.phase:<5} {r.duration:5.1f} s, failed {r.overall.failed}; load avg "
            f"{r.loadavg[0]:.2f} -> {r.loadavg[1]:.2f}; cores busy: stack {r.cores[0]:.2f}, "
            f"others {r.cores[1]:.2f}\n{'':<21} KV pulls {t['count']:.0f}, mean {mean_ms:.1f} "
            f"ms, {t['bytes'] / 2**20:.1f} MiB ({gbps:.2f} GB/s; moving the bytes alone "
            f"{read_ms:.1f} ms, {read_gbps:.2f} GB/s); decisions {d or '-'}"
        )
        summary["runs"].append({
            "mode": r.mode, "phase": r.phase, "duration_s": r.duration,
            "failed": r.overall.failed, "loadavg": r.loadavg, "cores": r.cores,
            "output_tok_s": r.overall.output_throughput, "kv_pulls": t["count"],
            "kv_transfer_mean_ms": mean_ms, "kv_transfer_bytes": t["bytes"], "decisions": d,
            "kv_read_mean_ms": read_ms,
            "long_ttft_ms": [x.ttft * 1000 for x in r.results if x.success and is_long(x, args)],
            "long_sent_s": [x.start - r.t0 for x in r.results if x.success and is_long(x, args)],
        })  # fmt: skip
    _print_claim(results, summary, args)
    return summary


def _print_claim(
    results: list[ModeResult], summary: dict[str, Any], args: argparse.Namespace
) -> None:
    """The claim: TTFT(disaggregated) <= TTFT(aggregated) + transfer time, per phase."""
    runs = {(x["mode"], x["phase"]): x for x in summary["runs"]}
    print()
    print("Long prompts, in workload order: TTFT ms (sent at s from the phase's start)")
    for r in results:
        run = runs[(r.mode, r.phase)]
        pairs = zip(run["long_ttft_ms"], run["long_sent_s"], strict=True)
        print(f"  {r.mode:<15} {r.phase:<5} " + " ".join(f"{v:6.0f} ({t:4.1f})" for v, t in pairs))
    for phase in ("alone", "mixed"):
        agg = [r for r in results if r.phase == phase and parse_mode(r.mode).base == "aggregated"]
        if not agg:
            continue
        agg_ttft = runs[(agg[0].mode, phase)]["long_ttft_ms"]
        if not agg_ttft:
            continue
        agg_mean = sum(agg_ttft) / len(agg_ttft)
        for r in results:
            if r.phase != phase or parse_mode(r.mode).base == "aggregated":
                continue
            run = runs[(r.mode, phase)]
            if not run["long_ttft_ms"]:
                continue
            excess = sum(run["long_ttft_ms"]) / len(run["long_ttft_ms"]) - agg_mean
            transfer = run["kv_transfer_mean_ms"]
            verdict = "within" if excess <= transfer else "EXCEEDS"
            print(f"  {phase}: {r.mode}: mean long TTFT {excess:+.0f} ms vs {agg[0].mode}; mean KV "
                  f"transfer {transfer:.1f} ms: {verdict} the bound")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--modes",
        default="aggregated,nixl",
        help="comma-separated, run in this order: aggregated | nixl | grpc, each optionally\n"
        "with +ompN (OMP_NUM_THREADS=N for every process of that stack) and +decN (N decode\n"
        "workers; aggregated+dec2: two replicas), e.g. nixl+omp1",
    )
    p.add_argument("--model", default=None, help="model for baton serve (default: its default)")
    p.add_argument(
        "--serve-args",
        default="",
        help="more arguments for every baton serve, e.g. '--device cuda --gpus 0,1'",
    )
    p.add_argument("--num-alone", type=int, default=2, help="long and short prompts sent alone")
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--num-short", type=int, default=12)
    p.add_argument("--long-len", type=int, default=2000)
    p.add_argument("--short-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--remote-prefill-threshold", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.0,
        help="before each timed phase, wait until other processes keep fewer cores than this\n"
        "busy (measured over 3 s; 0: do not wait)",
    )
    p.add_argument("--quiet-wait", type=float, default=300.0, help="at most this long (s)")
    p.add_argument("--log-dir", type=Path, default=None, help="keep serve logs and metrics here")
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()
    modes = parse_modes(p, args.modes)
    phases, warm = build_workload(args)
    print(f"load average at start: {os.getloadavg()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        results = [r for m in modes for r in run_mode(m, args, phases, warm, log_dir)]
    summary = report(results, args)
    print(f"\nload average at end: {os.getloadavg()}")
    write_summary(summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

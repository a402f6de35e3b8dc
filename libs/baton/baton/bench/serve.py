"""``baton bench serve``: load-test any OpenAI-compatible server, like ``vllm bench serve``.

Sends a workload (random prompts of an exact token length, or a JSONL file) as streamed
requests, either all at once, at a Poisson rate (``--request-rate``, gamma with
``--burstiness``), or both under a cap on requests in flight (``--max-concurrency``). Reports
throughput, TTFT, TPOT, ITL, end-to-end latency and goodput; optionally writes JSON and a
latency-CDF PNG. A failing request is recorded, not fatal; Ctrl-C stops and reports what
finished. Exit status: 0 if any request succeeded, 1 if none did, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from baton.bench.client import RequestConfig
from baton.bench.datasets import (
    SampleRequest,
    jsonl_requests,
    load_bench_tokenizer,
    random_requests,
)
from baton.bench.metrics import (
    BenchmarkMetrics,
    RequestResult,
    calculate_metrics,
    parse_goodput,
)
from baton.bench.report import format_table, plot_cdf, result_json
from baton.bench.runner import BenchmarkError, LoadShape, RunState, run_benchmark

ENDPOINTS = {"/v1/completions": False, "/v1/chat/completions": True}  # endpoint -> is chat


def add_args(p: argparse.ArgumentParser) -> None:
    """Register ``bench serve``'s flags (vLLM's names where vLLM has the flag)."""
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--host", default="127.0.0.1", help="server host when --base-url is unset")
    p.add_argument("--port", type=int, default=8000, help="server port when --base-url is unset")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="/v1/completions")
    p.add_argument("--model", default=None, help="model id (default: the server's first model)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer folder or .gguf (default: the default model)"
    )
    p.add_argument(
        "--dataset", "--dataset-name", dest="dataset", default="random", choices=("random", "jsonl")
    )
    p.add_argument("--dataset-path", type=Path, default=None, help="JSONL file for --dataset jsonl")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly in [len*(1-r), len*(1+r)]",
    )
    p.add_argument(
        "--jsonl-output-len",
        type=int,
        default=128,
        help="max_tokens for JSONL lines without output_len",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (inf: all at once)",
    )
    p.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps (1: Poisson)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (a vLLM extra)")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)"
    )
    p.add_argument("--top-p", type=float, default=None, help="send top_p (default: not sent)")
    p.add_argument("--top-k", type=int, default=None, help="send top_k, a vLLM extra")
    p.add_argument("--min-p", type=float, default=None, help="send min_p, a vLLM extra")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs for goodput: ttft:MS tpot:MS e2el:MS",
    )
    p.add_argument("--metric-percentiles", default="90,99", help="comma-separated percentiles")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument(
        "--initial-test",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send one short request first and stop if it fails",
    )
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", type=Path, default=Path("."))
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot-cdf", type=Path, default=None, metavar="PATH.png")
    p.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    p.add_argument("--disable-tqdm", action="store_true")


def root_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def discover_model(base_url: str, api_key: str | None) -> str:
    """The first model id the server lists at ``/v1/models``. Raises BenchmarkError."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise BenchmarkError(f"cannot list the models at {base_url}/v1/models: {e}") from None


def load_samples(args: argparse.Namespace) -> list[SampleRequest]:
    tokenizer = load_bench_tokenizer(args.tokenizer)
    try:
        if args.dataset == "jsonl":
            if args.dataset_path is None:
                raise BenchmarkError("--dataset jsonl needs --dataset-path")
            return jsonl_requests(
                tokenizer, args.dataset_path, args.num_prompts, args.jsonl_output_len
            )
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            seed=args.seed,
            range_ratio=args.random_range_ratio,
        )
    except (OSError, ValueError) as e:
        raise BenchmarkError(str(e)) from None


def _check_args(args: argparse.Namespace) -> tuple[dict[str, float], list[float]]:
    """Validate flags; return the SLOs and percentiles. Raises BenchmarkError."""
    if args.num_prompts < 1:
        raise BenchmarkError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchmarkError("--max-concurrency must be at least 1")
    if not args.request_rate > 0 or not args.burstiness > 0 or not args.request_timeout > 0:
        raise BenchmarkError("--request-rate, --burstiness and --request-timeout must be > 0")
    try:
        slos = parse_goodput(args.goodput or [])
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError as e:
        raise BenchmarkError(str(e)) from None
    if any(not 0 < p < 100 for p in percentiles):
        raise BenchmarkError("--metric-percentiles must lie strictly between 0 and 100")
    return slos, percentiles


def _args_json(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"func", "api_key"}
    return {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip
    }


def main(args: argparse.Namespace) -> int:
    """Run ``bench serve``. Raises BenchmarkError (or ModelLoadError) for what stops it before
    any request is timed; Ctrl-C before the run or during the report just exits with 130."""
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("\nInterrupted.")
        return 130


def _main(args: argparse.Namespace) -> int:
    slos, percentiles = _check_args(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    base = root_url(args)
    model = args.model or discover_model(base, args.api_key)
    samples = load_samples(args)
    cfg = RequestConfig(
        url=base + args.endpoint,
        model=model,
        chat=ENDPOINTS[args.endpoint],
        ignore_eos=args.ignore_eos,
        timeout_s=args.request_timeout,
        api_key=args.api_key,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
    )
    print(
        f"Benchmarking {model} at {cfg.url}: {len(samples)} prompts, request rate "
        f"{args.request_rate:g}, burstiness {args.burstiness:g}, "
        f"max concurrency {args.max_concurrency}"
    )
    shape = LoadShape(
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        initial_test=args.initial_test,
        show_progress=not args.disable_tqdm,
    )
    state = RunState(results=[None] * len(samples))
    interrupted = False
    try:
        asyncio.run(run_benchmark(cfg, samples, shape, state))
    except KeyboardInterrupt:
        interrupted = True
        print("\nInterrupted: reporting the requests that finished.")
    if state.start is None:
        return 130 if interrupted else 1
    done = [r for r in state.results if r is not None]
    duration = max((state.end or time.perf_counter()) - state.start, 1e-9)
    metrics = calculate_metrics(done, duration, percentiles, slos)
    _report(args, model, metrics, done, interrupted, len(samples))
    if interrupted:
        return 130
    return 0 if metrics.completed else 1


def _report(
    args: argparse.Namespace,
    model: str,
    metrics: BenchmarkMetrics,
    done: list[RequestResult],
    interrupted: bool,
    num_prompts: int,
) -> None:
    """Print the table and the first failure; write the JSON and the plot if asked."""
    print(format_table(metrics, args.max_concurrency, args.request_rate))
    if failure := next((r.error for r in done if not r.success), None):
        print(f"First failure: {failure}")
    rate = f"{args.request_rate:g}"
    date = time.strftime("%Y%m%d-%H%M%S")
    if args.save_result:
        extra = {"date": date, "backend": "openai", "model_id": model, "interrupted": interrupted}
        extra["tokenizer_id"] = args.tokenizer or "default"
        extra.update(num_prompts=num_prompts, request_rate=rate, args=_args_json(args))
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        safe_model = model.replace("/", "_")
        name = args.result_filename or f"baton-{rate}qps{concurrency}-{safe_model}-{date}.json"
        path = args.result_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result_json(metrics, done, extra), indent=2))
        print(f"Results written to {path}")
    if args.plot_cdf is not None:
        concurrency_text = args.max_concurrency or "unbounded"
        title = f"{model}: {len(done)} requests, concurrency {concurrency_text}, rate {rate}"
        plot_cdf(done, args.plot_cdf, title)
        print(f"Latency CDF plot written to {args.plot_cdf}")

"""``baton bench latency``: one request at a time against the offline engine (batch 1).

Each iteration submits one prompt of ``--input-len`` random token ids (a fresh prompt each time,
so the prefix cache never hits), asks for exactly ``--output-len`` tokens (greedy,
``ignore_eos``) and times every engine step:

- prefill: from submitting the request to the end of the step that produced its first token
  (one step unless the prompt is chunked across several);
- decode: each later step, which produces one token at batch 1;
- end to end: the whole request.

``--num-iters-warmup`` iterations run first and are not reported.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from baton.bench.metrics import LatencyStats, summarize

_PERCENTILES = (50.0, 90.0, 99.0)
_WIDTH = 50


class StepEngine(Protocol):
    """The part of ``EngineCore`` this benchmark drives."""

    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], params: Any) -> None: ...

    def step(self) -> Sequence[Any]: ...  # EngineCoreOutput: req_id, new_token_ids, finished

    def abort_requests(self, req_ids: Sequence[str]) -> None: ...


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One request's timings in seconds."""

    prefill: float  # submission -> end of the step that produced the first token
    decode: list[float]  # one per later step that produced a token
    latency: float  # submission -> end of the step that finished it
    num_output_tokens: int


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    p.add_argument("--num-iters", type=int, default=5, help="measured requests")
    p.add_argument("--num-iters-warmup", type=int, default=1, help="unmeasured requests first")
    p.add_argument("--output-json", type=Path, default=None)


def time_request(
    engine: StepEngine,
    req_id: str,
    prompt_token_ids: Sequence[int],
    params: Any,
    max_steps: int,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestTiming:
    """Run one request alone on ``engine`` to completion, timing each step with ``clock``.

    The engine must be idle. Raises RuntimeError (after aborting the request) if it has not
    finished within ``max_steps`` steps, or if it finished without producing a token.
    """
    start = clock()
    engine.add_request(req_id, prompt_token_ids, params)
    first: float | None = None
    last = start
    decode: list[float] = []
    num_tokens = 0
    for _ in range(max_steps):
        outputs = [o for o in engine.step() if o.req_id == req_id]
        now = clock()
        new = sum(len(o.new_token_ids) for o in outputs)
        if new:
            if first is None:
                first = now
            else:
                decode.extend([(now - last) / new] * new)
            num_tokens += new
            last = now
        if any(o.finished for o in outputs):
            if first is None:
                raise RuntimeError(f"request {req_id} finished without a token")
            return RequestTiming(first - start, decode, now - start, num_tokens)
    engine.abort_requests([req_id])
    raise RuntimeError(f"request {req_id} did not finish within {max_steps} steps")


def _format(args: argparse.Namespace, info: dict[str, Any], stats: dict[str, LatencyStats]) -> str:
    lines = [f"{' Latency Benchmark Result ':=^{_WIDTH}}"]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Model dtype / device:", f"{info['dtype']} / {info['device']}")
    row("Input / output tokens:", f"{args.input_len} / {args.output_len}")
    row("Measured requests (batch 1):", args.num_iters)
    titles = {"prefill": "Prefill (to first token)", "decode": "Decode per token (batch 1)"}
    titles["e2el"] = "End-to-end latency"
    for key, title in titles.items():
        s = stats[key]
        lines.append(f"{title:-^{_WIDTH}}")
        row(f"Mean {key} (ms):", s.mean, ".2f")
        for p, value in s.percentiles.items():
            row(f"P{p:g} {key} (ms):", value, ".2f")
        if key == "decode" and s.mean > 0:
            row("Decode throughput (tok/s):", 1000.0 / s.mean, ".1f")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from baton_engine.arg_utils import engine_kwargs_from_args
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore
    from baton_engine.errors import InvalidRequestError
    from baton_engine.sampling_params import SamplingParams

    if min(args.input_len, args.output_len, args.num_iters) < 1 or args.num_iters_warmup < 0:
        raise InvalidRequestError("lengths and --num-iters must be >= 1, warm-ups >= 0")
    try:
        config = EngineConfig(model=args.model, **engine_kwargs_from_args(args))
    except TypeError as e:
        raise InvalidRequestError(f"unknown engine argument: {e}") from None
    core = EngineCore(config)
    if args.input_len + args.output_len > core.max_model_len:
        raise InvalidRequestError(
            f"--input-len + --output-len exceeds max_model_len {core.max_model_len}"
        )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(config.seed)
    vocab = core.model_config.vocab_size
    max_steps = args.input_len + args.output_len + 8  # even 1-token prefill chunks fit
    timings: list[RequestTiming] = []
    for i in range(args.num_iters_warmup + args.num_iters):
        prompt = [rng.randrange(100, vocab) for _ in range(args.input_len)]
        timing = time_request(core, f"latency-{i}", prompt, params, max_steps)
        if i >= args.num_iters_warmup:
            timings.append(timing)
    stats = {
        "prefill": summarize([t.prefill for t in timings], _PERCENTILES),
        "decode": summarize([d for t in timings for d in t.decode], _PERCENTILES),
        "e2el": summarize([t.latency for t in timings], _PERCENTILES),
    }
    info = {"dtype": str(core.dtype).removeprefix("torch."), "device": config.device}
    print(_format(args, info, stats))
    if args.output_json:
        latencies = [t.latency for t in timings]
        out: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.node(),
            "model_dir": str(core.model_dir),
            **info,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters": args.num_iters,
            "avg_latency": sum(latencies) / len(latencies),  # seconds, as vLLM reports it
            "latencies": latencies,
            "prefill_times": [t.prefill for t in timings],
            "decode_times": [t.decode for t in timings],
        }
        for key, s in stats.items():
            out[f"mean_{key}_ms"] = s.mean
            out.update({f"p{p:g}_{key}_ms": v for p, v in s.percentiles.items()})
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(out, indent=2))
    return 0

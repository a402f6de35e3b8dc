"""The engine on a GPU: correctness checks, then throughput against Hugging Face, in one run.

    python benchmarks/bench_gpu_engine.py                 # on the H200: checks + both shapes
    python benchmarks/bench_gpu_engine.py --tiny --device cpu --no-hf   # a smoke run on CPU

Checks (dummy weights; a random-init Hugging Face model saved as safetensors for the logits):
  - greedy tokens of the triton backend (CUDA graphs) equal the torch backend's, float32 and bf16;
  - first-step logprobs (top 20) of Baton equal transformers' within bf16 tolerance.
Throughput (issue 5's workload): 256 prompts x 512 random token ids, 256 output tokens each,
ignore_eos, greedy, bf16, dummy weights; max_num_seqs 64 and 256, and batch-1 decode; the same
workload through transformers (sdpa, cuDNN SDPA off) in the same run; the share of the decode
roofline (weights + KV bytes read per step over the device copy bandwidth, 4.28 TB/s on the
H200); and per decode step the GPU time of the decode graph's replay (at the inputs of the
run's last step with every row a request: ``FullStepRecorder``) next to the step's wall time. Each
engine configuration runs in a fresh process (``--in-process`` builds them all in this one).
Results are printed as they come and written to $OUT/bench_gpu_engine.json (benchmarks/out/
without $OUT; or --output-json).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend on CPU (smoke runs)

from baton_engine.config import EngineConfig, ModelConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams

CONFIGS = Path(__file__).parent / "configs"
SHAPES = {
    "qwen": CONFIGS / "qwen2.5-0.5b",
    "llama": CONFIGS / "llama-3.1-8b",
    "llama70b": CONFIGS / "llama-3.1-70b",  # tensor parallelism only (device/tp_probe.py)
    "qwen3moe": CONFIGS / "qwen3-30b-a3b",  # a mixture of experts: 128 experts, 8 a token
    "gemma3": CONFIGS / "gemma-3-1b",  # 5 of 6 layers attend to their last 512 tokens
    # compressed-tensors' W4A16 (4-bit weights, a scale a group of 128): packed layers on GPUs
    "llama-w4": CONFIGS / "llama-3.1-8b-w4a16",
    "qwen-w4": CONFIGS / "qwen2.5-0.5b-w4a16",
}
COPY_BANDWIDTH = 4.28e12  # bytes/s, device-to-device copy on the H200 (read + write counted)
TINY = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 224,  # 14 heads of 16: Qwen2.5-0.5B's GQA ratio of 7
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
    "torch_dtype": "bfloat16",
}

RESULTS: dict[str, Any] = {"checks": {}, "throughput": []}


def emit(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(RESULTS, indent=2))


def engine(model: Path, args: argparse.Namespace, **kw: Any) -> EngineCore:
    config = dict(
        model=str(model),
        load_format="dummy",
        dtype="bfloat16",
        device=args.device,
        max_model_len=max(args.prompt_len + args.output_len + 16, 256),
        max_num_seqs=args.num_prompts,
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        block_size=getattr(args, "block_size", None) or EngineConfig.block_size,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None) or "auto",
        quantization=getattr(args, "quantization", None),
        # alone in its process, the server's default; else room for what an earlier engine in
        # this process may not have freed
        gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None)
        or (0.9 if args.only_config else 0.6),
        num_scheduler_steps=getattr(args, "num_scheduler_steps", 1),
        seed=0,
    )
    if args.device == "cpu":
        config["num_gpu_blocks_override"] = 2048
    config.update(kw)
    return EngineCore(EngineConfig(**config))  # type: ignore[arg-type]


def probe_args(description: str | None) -> argparse.ArgumentParser:
    """The options of the device probes (``benchmarks/device/*.py``): one shape of issue 5's
    workload (``tiny``: a smoke run on CPU), one engine alone in its process."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--shape", default="qwen", help="qwen, llama or tiny")
    p.add_argument("--batch", type=int, default=256, help="max_num_seqs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-scheduler-steps", type=int, default=1)
    p.add_argument("--only-config", default="1", help=argparse.SUPPRESS)  # engine(): alone
    return p


def probe_model(shape: str) -> Path:
    """The config folder of ``shape`` (``tiny``: a temporary one)."""
    if shape != "tiny":
        return SHAPES[shape]
    model = Path(tempfile.mkdtemp())
    (model / "config.json").write_text(json.dumps(TINY))
    return model


def probe_engine(
    args: argparse.Namespace, **engine_args: Any
) -> tuple[EngineCore, ModelConfig, SamplingParams]:
    """A device probe's engine for ``probe_args``, built as the benchmark builds it (with
    ``engine_args`` on top), and the workload's sampling parameters."""
    model = probe_model(args.shape)
    mc = ModelConfig.from_path(model)
    core = engine(model, args, max_num_seqs=args.batch, **engine_args)
    return core, mc, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)


def warm_up(core: EngineCore, mc: ModelConfig, params: SamplingParams) -> None:
    """What the benchmark runs before its measured run: four 32-token prompts."""
    batch = core.config.max_num_seqs
    run_all(core, random_prompts(min(4, batch), 32, mc.vocab_size, seed=9), params)


def run_all(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Add every prompt, step until done; tokens per request and step timings."""
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {}
    # (batch, seconds) of decode-only steps; a step of k passes (multi-step scheduling) counts
    # as k steps of a k-th of its time each
    decode_steps: list[tuple[int, float]] = []
    other_steps: list[float] = []  # seconds of steps with prompt tokens
    first_token: float | None = None
    start = time.perf_counter()
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        so_running = core.scheduler.num_running
        outs = core.step()
        dt = time.perf_counter() - t0
        if first_token is None and outs:
            first_token = time.perf_counter()
        if outs and len(outs) == so_running and not core.scheduler.num_waiting:
            passes = max(len(o.new_token_ids) for o in outs)
            decode_steps += [(len(outs), dt / passes)] * passes
        else:
            other_steps.append(dt)
        for o in outs:
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
    elapsed = time.perf_counter() - start
    return {
        "tokens": tokens,
        "elapsed": elapsed,
        "first_token": (first_token or start) - start,
        "decode_steps": decode_steps,
        "other_steps": other_steps,
    }


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


# --- checks --------------------------------------------------------------------------------------


def check_backends(model: Path, args: argparse.Namespace) -> None:
    mc = ModelConfig.from_path(model)
    prompts = random_prompts(8, 64, mc.vocab_size, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for dtype in ("float32", "bfloat16"):
        runs = {}
        for backend in ("torch", "triton"):
            core = engine(
                model,
                args,
                dtype=dtype,
                attention_backend=backend,
                max_num_seqs=8,
                async_scheduling=backend != "torch",  # the reference runs synchronously
            )
            runs[backend] = run_all(core, prompts, params)["tokens"]
            del core
            free()
        same = sum(runs["torch"][k] == runs["triton"][k] for k in runs["torch"])
        agree = sum(
            a == b
            for k in runs["torch"]
            for a, b in zip(runs["torch"][k], runs["triton"][k], strict=True)
        )
        total = sum(len(v) for v in runs["torch"].values())
        RESULTS["checks"][f"greedy_triton_vs_torch_{dtype}"] = {
            "identical_sequences": f"{same}/{len(prompts)}",
            "tokens_agreeing": f"{agree}/{total}",
        }
        print(f"greedy triton vs torch ({dtype}): {same}/{len(prompts)} sequences identical, "
              f"{agree}/{total} tokens", flush=True)  # fmt: skip


def check_hf_logits(model: Path, args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(model)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, torch_dtype=torch.bfloat16)
    with torch.no_grad():  # a larger init than HF's default, so the distribution is not flat
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.05)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        hf = hf.to(args.device).eval()
        prompts = random_prompts(4, 48, hf_config.vocab_size, seed=2)
        core = engine(Path(tmp), args, load_format="auto", max_num_seqs=4)
        params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
        for i, p in enumerate(prompts):
            core.add_request(f"h{i}", p, params)
        got = {}
        while core.has_unfinished_requests():
            for o in core.step():
                got[o.req_id] = o.new_logprobs[0] if o.new_logprobs else None
        del core
    worst, top1 = 0.0, 0
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=args.device)
            ref = hf(ids).logits[0, -1].float().log_softmax(-1)
            lp = got[f"h{i}"]
            assert lp is not None
            mine = torch.tensor(lp.logprobs[1:], device=args.device)
            theirs = ref[torch.tensor(lp.token_ids[1:], device=args.device)]
            worst = max(worst, float((mine - theirs).abs().max()))
            top1 += int(lp.token_ids[0] == int(ref.argmax()))
    del hf
    free()
    RESULTS["checks"]["hf_first_step_logprobs"] = {
        "max_abs_diff_top20": worst,
        "top1_agree": f"{top1}/{len(prompts)}",
    }
    print(f"first-step logprobs vs transformers: max |diff| over top-20 {worst:.4f}, "
          f"argmax agrees {top1}/{len(prompts)}", flush=True)  # fmt: skip


# --- throughput ----------------------------------------------------------------------------------


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def roofline(mc: ModelConfig, batch: int, context: float, dtype_bytes: int = 2) -> float:
    """Output tokens/s if a decode step only had to read the weights and the batch's KV. A
    mixture of experts' step reads the experts its tokens chose: with routing uniform at
    random (as dummy weights route), each expert is chosen by one of ``batch`` tokens with
    probability ``1 - (1 - k / E) ** batch``. A sliding-window layer reads at most its window's
    KV."""
    h, layers = mc.hidden_size, mc.num_layers
    kv_dim = mc.num_kv_heads * mc.head_dim
    attn = h * (mc.num_heads * mc.head_dim) * 2 + h * kv_dim * 2
    mlp = 0.0
    for i in range(layers):
        if mc.is_moe_layer(i):
            e, k = mc.num_experts, mc.num_experts_per_tok
            read = e * (1 - (1 - k / e) ** batch)
            mlp += read * 3 * h * mc.moe_intermediate_size + h * e
            mlp += 3 * h * mc.shared_expert_intermediate_size
        else:
            mlp += 3 * h * mc.intermediate_size
    embed = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2)
    weight_bytes = (layers * attn + mlp + embed) * dtype_bytes
    kv_tokens = sum(min(context, mc.layer_window(i) or context) for i in range(layers))
    kv_bytes = batch * kv_tokens * 2 * kv_dim * dtype_bytes
    return batch / ((weight_bytes + kv_bytes) / COPY_BANDWIDTH)


class FullStepRecorder:
    """Keeps the inputs of the last decode step that filled ``batch`` rows of the captured
    graphs (``DecodeGraphs.run``'s arguments; a reference per step, no copy), so that the
    graph's replay can be timed after the run at that state. The graph's buffers themselves
    end the run holding its last step, whose rows are mostly padding (length 1) when the
    requests finished at different steps: a replay then reads almost no KV."""

    def __init__(self, core: EngineCore, batch: int) -> None:
        self.graphs = core.runner.graphs
        self.last: dict[str, Any] | None = None  # the step's numpy inputs, by argument name
        if self.graphs is None:
            return
        run = self.graphs.run

        def recording(**kw: Any) -> Any:
            if len(kw["input_ids"]) == batch and kw["block_tables"] is not None:
                self.last = kw
            return run(**kw)

        self.graphs.run = recording  # type: ignore[method-assign]

    def replay_seconds(self, reps: int = 20) -> float | None:
        """The graph's GPU time at the recorded step (None without graphs or such a step)."""
        graphs = self.graphs
        if graphs is None or self.last is None or not torch.cuda.is_available():
            return None
        vars(graphs).pop("run", None)  # the class's own again
        inputs = {k: v for k, v in self.last.items() if k not in ("patch", "host")}
        size = graphs.padded_size(len(inputs["input_ids"]))
        graph = graphs._graphs.get((False, size)) if size is not None else None  # (LoRA off)
        if graph is None:
            return None
        graphs.run(**inputs)  # the step's inputs into the buffers, and one replay
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return float(start.elapsed_time(end)) / reps / 1000


def run_isolated(name: str, max_seqs: int, async_mode: bool, args: argparse.Namespace) -> None:
    """One engine configuration in a fresh Python process, as a server runs one engine per
    process: an engine built after others in the same process ran batch-1 decode up to ~10%
    slower (sixth session), which would measure the benchmark, not the engine."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "one.json"
        cmd = [
            sys.executable, __file__, "--device", args.device, "--shapes", name,
            "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--no-hf", "--no-checks",
            "--only-config", f"{max_seqs}:{int(async_mode)}", "--output-json", str(out),
            "--temperature", str(args.temperature), "--top-p", str(args.top_p),
            "--num-scheduler-steps", str(args.num_scheduler_steps),
        ]  # fmt: skip
        if args.tiny:
            cmd.append("--tiny")
        if args.max_num_batched_tokens is not None:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.block_size is not None:
            cmd += ["--block-size", str(args.block_size)]
        if args.kv_cache_dtype != "auto":
            cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
        if args.quantization is not None:
            cmd += ["--quantization", args.quantization]
        subprocess.run(cmd, check=True)
        child = json.loads(out.read_text())
    RESULTS["throughput"] += child["throughput"]
    for title, error in child.get("errors", {}).items():
        RESULTS.setdefault("errors", {})[f"{title} {max_seqs}"] = error


def bench_baton(name: str, model: Path, args: argparse.Namespace) -> None:
    mc = ModelConfig.from_path(model)
    prompts = random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.output_len,
        ignore_eos=True,
    )
    sync_too = {int(b) for b in args.compare_sync.split(",") if b}
    configs = [
        (int(b) or args.num_prompts, m)
        for b in args.batches.split(",")
        for m in ([True, False] if int(b) in sync_too else [True])
    ]
    if args.only_config:
        batch, mode = args.only_config.split(":")
        configs = [(int(batch), bool(int(mode)))]
    for max_seqs, async_scheduling in configs:
        if not args.in_process and not args.only_config:
            run_isolated(name, max_seqs, async_scheduling, args)
            emit(args.output_json)
            continue
        batch_prompts = prompts[:1] if max_seqs == 1 else prompts
        core = engine(model, args, max_num_seqs=max_seqs, async_scheduling=async_scheduling)
        name_mode = f"{name}{'' if async_scheduling else ' (sync)'}"
        warm_up(core, mc, params)
        recorder = FullStepRecorder(core, max_seqs)
        r = run_all(core, batch_prompts, params)
        n_out = sum(len(t) for t in r["tokens"].values())
        steps = [dt for b, dt in r["decode_steps"] if b == max_seqs] or [
            dt for _, dt in r["decode_steps"]
        ]
        step_wall = sorted(steps)[len(steps) // 2] if steps else float("nan")
        replay = recorder.replay_seconds()
        if max_seqs == 1:
            tps = (len(steps) / sum(steps)) if steps else float("nan")
        else:
            tps = n_out / r["elapsed"]
        context = args.prompt_len + args.output_len / 2
        roof = roofline(mc, max_seqs, context)
        row = {
            "shape": name,
            "engine": "baton",
            "async_scheduling": async_scheduling,
            "batch": max_seqs,
            "num_scheduler_steps": args.num_scheduler_steps,
            "output_tok_s": tps,
            "roofline_tok_s": roof,
            "share_of_roofline": tps / roof,
            "median_decode_step_ms": step_wall * 1e3,
            "graph_replay_ms": replay * 1e3 if replay is not None else None,
            "elapsed_s": r["elapsed"],
            "num_blocks": core.kv.pool.num_blocks,
        }
        RESULTS["throughput"].append(row)
        replay_txt = f"{replay * 1e3:.2f}" if replay is not None else "-"
        other = r["other_steps"]
        row["prompt_steps"] = len(other)
        row["prompt_steps_s"] = sum(other)
        row["decode_steps_s"] = sum(dt for _, dt in r["decode_steps"])
        print(f"{name_mode:6} baton batch {max_seqs:>3}: {len(other)} steps with prompt tokens "
              f"{sum(other):.2f} s (longest {max(other, default=0) * 1e3:.0f} ms), "
              f"{len(r['decode_steps'])} decode-only steps {row['decode_steps_s']:.2f} s, "
              f"first token {r['first_token']:.2f} s", flush=True)  # fmt: skip
        if steps:
            # The mean step sets batch 1's figure: name the steps that pull it above the median.
            slow = sorted(enumerate(steps), key=lambda x: -x[1])[:8]
            row["slowest_decode_steps_ms"] = [(i, dt * 1e3) for i, dt in slow]
            print(f"{name_mode:6} baton batch {max_seqs:>3}: decode step mean "
                  f"{sum(steps) / len(steps) * 1e3:.2f} ms, median {step_wall * 1e3:.2f} ms, "
                  f"{sum(dt > 2 * step_wall for dt in steps)} above twice the median; slowest "
                  + ", ".join(f"#{i} {dt * 1e3:.1f}" for i, dt in slow), flush=True)  # fmt: skip
        print(f"{name_mode:6} baton batch {max_seqs:>3}: {tps:9.0f} tok/s ({tps / roof:5.1%} of "
              f"roofline {roof:.0f}); decode step {step_wall * 1e3:.2f} ms wall, graph "
              f"{replay_txt} ms GPU", flush=True)  # fmt: skip
        del core
        free()
        emit(args.output_json)


def bench_hf(name: str, model: Path, args: argparse.Namespace) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.backends.cuda.enable_cudnn_sdp(False)
    cfg = AutoConfig.from_pretrained(model)
    with torch.device(args.device):
        hf = AutoModelForCausalLM.from_config(
            cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
        )
    hf.eval()
    mc = ModelConfig.from_path(model)
    prompts = torch.tensor(random_prompts(args.num_prompts, args.prompt_len, mc.vocab_size))
    for batch in (64, args.num_prompts, 1):
        waves = prompts[:1] if batch == 1 else prompts
        start = time.perf_counter()
        n_out = 0
        with torch.no_grad():
            for i in range(0, len(waves), batch):
                ids = waves[i : i + batch].to(args.device)
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.output_len,
                    min_new_tokens=args.output_len,
                    do_sample=False,
                    pad_token_id=0,
                )
                n_out += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        tps = n_out / (time.perf_counter() - start)
        RESULTS["throughput"].append(
            {"shape": name, "engine": "hf", "batch": batch, "output_tok_s": tps}
        )
        print(f"{name:6} hf    batch {batch:>3}: {tps:9.0f} tok/s", flush=True)
        emit(args.output_json)
    del hf
    free()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="qwen,llama")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batches", default="64,0,1", help="max_num_seqs values (0: all prompts)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, help="the step budget (default: the engine's)"
    )
    p.add_argument("--block-size", type=int, help="tokens per KV block (default: the engine's, 16)")
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's (auto, fp8, fp8_e5m2)")
    p.add_argument("--quantization", default=None, help="the engine's (fp8: FP8 layers, W8A8)")
    p.add_argument(
        "--compare-sync", default="", help="batches (as --batches) to run without async too"
    )
    p.add_argument(
        "--num-scheduler-steps", type=int, default=1, help="the engine's (multi-step scheduling)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="the engine's (default: 0.9 alone in a process, else 0.6)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--temperature", type=float, default=0.0, help="Baton's sampling (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="Baton's sampling")
    p.add_argument("--no-checks", action="store_true")
    p.add_argument("--no-throughput", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a tiny model and workload (smoke test)")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="build every engine in this process (default: each in a fresh one)",
    )
    p.add_argument("--only-config", default="", help=argparse.SUPPRESS)  # BATCH:ASYNC, a child
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()
    if args.output_json is None:
        args.output_json = Path(os.environ.get("OUT", "benchmarks/out")) / "bench_gpu_engine.json"
    tmp = None
    if not args.tiny:
        shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    else:
        tmp = tempfile.TemporaryDirectory()
        (Path(tmp.name) / "config.json").write_text(json.dumps(TINY))
        shapes = {"tiny": Path(tmp.name)}
        args.num_prompts, args.prompt_len, args.output_len = 8, 32, 16
    RESULTS["args"] = {k: str(v) for k, v in vars(args).items()}
    if torch.cuda.is_available():
        RESULTS["device"] = torch.cuda.get_device_name()
    sections: list[tuple[str, Any, Path]] = []
    if not args.no_checks:
        check_model = next(iter(shapes.values()))
        sections += [("backends", check_backends, check_model)]
        sections += [("hf logits", check_hf_logits, check_model)]
    if not args.no_throughput:
        for name, model in shapes.items():
            sections.append((f"baton {name}", lambda m, a, n=name: bench_baton(n, m, a), model))
            if not args.no_hf:
                sections.append((f"hf {name}", lambda m, a, n=name: bench_hf(n, m, a), model))
    for title, fn, model in sections:
        try:  # one failing section must not cost the others (device time is scarce)
            fn(model, args)
        except Exception as e:
            import traceback

            traceback.print_exc()
            RESULTS.setdefault("errors", {})[title] = repr(e)
            print(f"section {title} failed: {e!r}", flush=True)
        free()
        emit(args.output_json)
    emit(args.output_json)
    print(json.dumps(RESULTS["throughput"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

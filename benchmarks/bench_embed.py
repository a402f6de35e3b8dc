"""Embedding throughput of the engine against Hugging Face transformers, in one run.

    python benchmarks/bench_embed.py                                # CPU: the default model
    python benchmarks/bench_embed.py --shape qwen --device cuda     # GPU: dummy weights, bf16

Workload: ``--num-prompts`` prompts of ``--input-len`` random token ids, all submitted at once;
each is one embedding (the final hidden state at its last token, L2-normalized: what
``LLM.embed`` and ``/v1/embeddings`` return). Baton runs them as embedding requests through its
scheduler (chunked prefill under the step's token budget); transformers runs its base model
forward (sdpa; cuDNN SDPA off on CUDA) on batches of ``--hf-batch-size`` (the prompts are of one
length: no padding) and pools the same way. Reported: prompt tokens/s and embeddings/s of each,
and, when both have the same weights (the default model, or ``MODEL`` given), the largest
difference between their embeddings and the smallest cosine similarity.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from baton_engine.config import EngineConfig, ModelConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.model_loader import resolve_model
from baton_engine.pooling_params import PoolingParams

CONFIGS = Path(__file__).parent / "configs"
SHAPES = {"qwen": CONFIGS / "qwen2.5-0.5b", "llama": CONFIGS / "llama-3.1-8b"}


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (num, length), generator=g).tolist()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_baton(args: argparse.Namespace, model: str, prompts: list[list[int]]) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=max(args.input_len + 16, 256),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    if args.shape is not None:
        kwargs["load_format"] = "dummy"
    if args.device.startswith("cuda"):
        kwargs["gpu_memory_utilization"] = 0.8
    core = EngineCore(EngineConfig(**kwargs))
    params = PoolingParams()

    def embed_all(core: EngineCore, batch: list[list[int]]) -> dict[str, list[float]]:
        for i, ids in enumerate(batch):
            core.add_request(f"e{i}", ids, params)
        pooled: dict[str, list[float]] = {}
        for _ in range(100 * len(batch) + 100):  # bounded: a step embeds at least one
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                if out.pooled is not None:
                    pooled[out.req_id] = out.pooled
        assert len(pooled) == len(batch), "some embedding did not finish"
        return pooled

    embed_all(core, prompts[: min(8, len(prompts))])  # warm-up: graphs, kernels, allocator
    sync(args.device)
    start = time.perf_counter()
    pooled = embed_all(core, prompts)
    sync(args.device)
    elapsed = time.perf_counter() - start
    result = {
        "seconds": elapsed,
        "dtype": str(core.dtype).removeprefix("torch."),
        "model_dir": str(core.model_dir),
        "embeddings": [pooled[f"e{i}"] for i in range(len(prompts))],
    }
    del core
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def run_hf(
    args: argparse.Namespace, model_dir: str, dtype: str, prompts: list[list[int]], dummy: bool
) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModel

    if args.device.startswith("cuda"):
        torch.backends.cuda.enable_cudnn_sdp(False)  # recompiles per length on this image
    torch_dtype = getattr(torch, dtype)
    with torch.device(args.device):
        if dummy:
            cfg = AutoConfig.from_pretrained(model_dir)
            hf = AutoModel.from_config(cfg, dtype=torch_dtype, attn_implementation="sdpa")
        else:
            hf = AutoModel.from_pretrained(
                model_dir, dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True
            )
    hf.eval()
    ids = torch.tensor(prompts)
    bs = args.hf_batch_size
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        hf(ids[:1].to(args.device))  # warm-up
        sync(args.device)
        start = time.perf_counter()
        for i in range(0, len(prompts), bs):
            hidden = hf(ids[i : i + bs].to(args.device)).last_hidden_state[:, -1]
            out.append(torch.nn.functional.normalize(hidden.float(), dim=-1).cpu())
        sync(args.device)
        elapsed = time.perf_counter() - start
    del hf
    gc.collect()
    return {"seconds": elapsed, "embeddings": torch.cat(out)}


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", default=None, help="model folder (default: SmolLM2)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="dummy weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output-json", type=Path, default=None)
    args = p.parse_args()

    model = str(SHAPES[args.shape]) if args.shape else str(resolve_model(args.model))
    vocab = ModelConfig.from_path(Path(model)).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab)
    num_tokens = args.num_prompts * args.input_len
    baton = run_baton(args, model, prompts)
    rows = [("baton", baton["seconds"])]
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "model": model,
        "dtype": baton["dtype"],
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
    }
    if args.hf:
        hf = run_hf(args, baton["model_dir"], baton["dtype"], prompts, args.shape is not None)
        rows.append((f"hf forward (bs={args.hf_batch_size})", hf["seconds"]))
        if args.shape is None:  # the same weights: the embeddings must agree
            ours = torch.tensor(baton["embeddings"])
            report["max_abs_diff"] = float((ours - hf["embeddings"]).abs().max())
            report["min_cosine"] = float((ours * hf["embeddings"]).sum(-1).min())
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} tokens, one embedding each, "
        f"dtype={baton['dtype']}, {report['device']}"
    )
    print(f"{'engine':<28} {'prompt tok/s':>12} {'embeddings/s':>13}")
    for name, seconds in rows:
        print(f"{name:<28} {num_tokens / seconds:>12.0f} {args.num_prompts / seconds:>13.1f}")
        report[name] = {"prompt_tok_s": num_tokens / seconds}
    if len(rows) > 1:
        print(f"{'baton / hf':<28} {rows[1][1] / rows[0][1]:>12.2f}x")
    if "max_abs_diff" in report:
        print(
            f"baton vs hf embeddings: max |diff| {report['max_abs_diff']:.2e}, "
            f"min cosine {report['min_cosine']:.6f}"
        )
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

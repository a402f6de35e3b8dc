"""Offline throughput: N requests of random prompt tokens, all submitted at once, greedy,
``ignore_eos``; Baton's engine and, in the same run, Hugging Face transformers static batching."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from pathlib import Path
from typing import Any


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure Hugging Face transformers static batching in the same run",
    )
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--output-json", type=Path, default=None)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the special tokens at the start of the vocabulary.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(num)]


def run_baton(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[float, Any]:
    from baton_engine.arg_utils import engine_kwargs_from_args
    from baton_engine.llm import LLM
    from baton_engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs_from_args(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    engine = llm.engine.core
    info = {"dtype": str(engine.dtype).removeprefix("torch."), "model_dir": str(engine.model_dir)}
    del llm
    gc.collect()
    return num_out / elapsed, info


def run_hf(args: argparse.Namespace, prompts: list[list[int]], model_dir: str, dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), local_files_only=True
    )
    model.train(False)
    bs = args.hf_batch_size
    num_out = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), bs):
            batch = prompts[i : i + bs]
            width = max(map(len, batch))
            pad = model.config.eos_token_id or 0
            pad = pad[0] if isinstance(pad, list) else pad
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=pad,
            )
            num_out += (out.shape[1] - width) * len(batch)
    return num_out / (time.perf_counter() - start)


def main(args: argparse.Namespace) -> int:
    from baton_engine.config import ModelConfig
    from baton_engine.model_loader import resolve_model

    vocab = ModelConfig.from_path(resolve_model(args.model)).vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.dataset_seed)
    baton_tps, info = run_baton(args, prompts)
    rows = [("baton", baton_tps)]
    if args.hf:
        rows.append(
            (
                f"hf static batching (bs={args.hf_batch_size})",
                run_hf(args, prompts, info["model_dir"], info["dtype"]),
            )
        )
    print(
        f"\n{args.num_prompts} requests x ({args.input_len} in, {args.output_len} out), "
        f"greedy, ignore_eos, dtype={info['dtype']}"
    )
    print(f"{'engine':<34} {'output tok/s':>12}")
    for name, tps in rows:
        print(f"{name:<34} {tps:>12.1f}")
    if len(rows) > 1:
        print(f"{'baton / hf':<34} {rows[0][1] / rows[1][1]:>12.2f}x")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "machine": platform.node(),
                    "dtype": info["dtype"],
                    "num_prompts": args.num_prompts,
                    "input_len": args.input_len,
                    "output_len": args.output_len,
                    "results": {name: tps for name, tps in rows},
                },
                indent=2,
            )
        )
    return 0

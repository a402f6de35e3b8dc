"""Speculative decoding with a draft model against plain decoding, through ``EngineCore``.

Each configuration is a fresh engine (the same seed): no drafts, then a draft model at each
``--k``, at each ``--batch`` (``max_num_seqs``). ``--prompts`` requests, greedy, each asking for
``--max-tokens`` tokens (``ignore_eos``), run to the end after a warm-up request; the table
gives output tokens per second, the speed-up over no drafts at that batch, the time of an
engine step (a step with drafts checks them and runs the draft for the next), the share of drafts
kept, and whether every request's tokens equal those without drafts.

``--draft`` is a model folder, or ``exit:N``: the model's own first N layers with its
embeddings, final norm and head (an "early exit" of it, written to a temporary folder; with
``--load-format dummy`` a config of N layers, whose random weights are the model's first N
layers' when its embeddings are tied: the weights are drawn in order from the same seed), or
``itself`` (the model as its own draft: nearly every draft kept, what the machinery costs at
full acceptance). The prompts are the chat prompts of ``bench_spec_decode.py`` ("copy" and
"open") with a tokenizer, else ``--prompt-len`` random token ids.

    python benchmarks/bench_draft_model.py --draft exit:8 --k 3                     # CPU
    python benchmarks/bench_draft_model.py --model benchmarks/configs/qwen2.5-0.5b \\
        --load-format dummy --device cuda --dtype bfloat16 --draft exit:2 --batch 1,8 --k 2,4
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import tempfile
import time
from pathlib import Path
from typing import Any


def early_exit(model_dir: Path, folder: Path, layers: int, dummy: bool) -> Path:
    """``model_dir``'s first ``layers`` layers as a model folder (config only when ``dummy``)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if not dummy:
        from safetensors.torch import load_file, save_file

        tensors = {}
        for path in sorted(model_dir.glob("*.safetensors")):
            for name, tensor in load_file(path).items():
                parts = name.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                    continue
                tensors[name] = tensor
        save_file(tensors, folder / "model.safetensors")
    return folder


def prompts(model_dir: Path, args: argparse.Namespace, vocab: int) -> list[list[int]]:
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from bench_spec_decode import workloads

        from baton_engine.model_files import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        chats = [c for chats in workloads().values() for c in chats]
        texts = [
            tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
            for c in chats[: args.prompts]
        ]
        return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    rng = random.Random(0)
    return [
        [rng.randrange(100, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]


def run(args: argparse.Namespace, batch: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore
    from baton_engine.sampling_params import SamplingParams

    core = EngineCore(
        EngineConfig(
            model=args.model_dir, load_format=args.load_format, device=args.device,
            dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=batch,
            speculative_config=spec, gpu_memory_utilization=args.gpu_memory_utilization,
            seed=0,
        )
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        todo = prompts(Path(args.model_dir), args, core.model_config.vocab_size)
        core.add_request("warm-up", todo[0][:32], SamplingParams(temperature=0.0, max_tokens=8))
        while core.has_unfinished_requests():
            core.step()
        sched = core.scheduler
        drafts0, accepted0 = sched.num_draft_tokens, sched.num_accepted_tokens
        tokens: dict[str, list[int]] = {}
        profiler = cProfile.Profile() if args.profile and spec is not None else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        for i, prompt in enumerate(todo):
            core.add_request(f"r{i}", prompt, params)
        steps = 0
        while core.has_unfinished_requests():
            steps += 1
            for out in core.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        seconds = time.perf_counter() - start
        if profiler is not None:
            profiler.disable()
            stats = pstats.Stats(profiler).strip_dirs()
            for key in ("cumulative", "tottime"):
                stats.sort_stats(key).print_stats(args.profile)
        return {
            "seconds": seconds,
            "steps": steps,
            "tokens": tokens,
            "drafts": sched.num_draft_tokens - drafts0,
            "accepted": sched.num_accepted_tokens - accepted0,
        }
    finally:
        core.shutdown()
        del core
        gc.collect()
        if args.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--draft", default="exit:8", help="a folder, exit:N or itself")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1", help="max_num_seqs values, comma-separated")
    parser.add_argument("--k", default="3", help="num_speculative_tokens values, comma-separated")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256, help="random prompts' length")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        help="print the top N functions (cProfile) of each run with drafts",
    )
    parser.add_argument(
        "--prompt-first-pass",
        action="store_true",
        help="the draft's first pass as a prompt step (its piecewise graphs on GPUs) even when "
        "a few tokens a request would run as decode rows",
    )
    args = parser.parse_args()
    if args.prompt_first_pass:
        from baton_engine.runner import draft as draft_module

        draft_module.SPLIT_FIRST_PASS = False
    from baton_engine.model_files import resolve_model

    model_dir = resolve_model(args.model)
    args.model_dir = str(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        if args.draft == "itself":
            draft = args.model_dir
        elif args.draft.startswith("exit:"):
            layers = int(args.draft.split(":", 1)[1])
            dummy = args.load_format == "dummy"
            draft = str(early_exit(model_dir, Path(tmp) / "draft", layers, dummy))
        else:
            draft = args.draft
        print(f"model {args.model or 'default'}, draft {args.draft}, {args.prompts} prompts, "
              f"max_tokens {args.max_tokens}, {args.device} {args.dtype}")  # fmt: skip
        print(f"{'batch':>5} {'K':>2} {'tok/s':>9} {'x':>6} {'ms/step':>8} {'drafts':>7} "
              f"{'kept':>6} {'same tokens':>12}")  # fmt: skip
        for batch in (int(b) for b in args.batch.split(",")):
            base = run(args, batch, None)
            base_rate = sum(map(len, base["tokens"].values())) / base["seconds"]
            base_ms = 1e3 * base["seconds"] / base["steps"]
            print(f"{batch:>5} {0:>2} {base_rate:>9.1f} {1:>6.2f} {base_ms:>8.3f} {'-':>7} "
                  f"{'-':>6} {'-':>12}", flush=True)  # fmt: skip
            for k in (int(k) for k in args.k.split(",")):
                got = run(args, batch, {"model": draft, "num_speculative_tokens": k})
                rate = sum(map(len, got["tokens"].values())) / got["seconds"]
                kept = f"{got['accepted'] / got['drafts']:.0%}" if got["drafts"] else "-"
                same = got["tokens"] == base["tokens"]
                ms = 1e3 * got["seconds"] / got["steps"]
                print(f"{batch:>5} {k:>2} {rate:>9.1f} {rate / base_rate:>6.2f} {ms:>8.3f} "
                      f"{got['drafts']:>7} {kept:>6} {same!s:>12}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

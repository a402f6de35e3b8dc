"""What serving LoRA adapters costs: generation throughput without LoRA, with LoRA enabled but
unused, with one adapter for every request, and with several adapters mixed in every step, in
one run (each configuration a fresh engine).

    python benchmarks/bench_lora.py                               # CPU: the default model
    python benchmarks/bench_lora.py --shape qwen --device cuda    # GPU: dummy weights, bf16

Workload: ``--num-prompts`` prompts of ``--input-len`` random token ids, ``--output-len`` tokens
each (``ignore_eos``, greedy), all submitted at once. The adapters are random, of rank
``--rank``, on all seven projections of every layer (PEFT folders written to a temporary
directory). "mixed" spreads the requests round robin over ``--num-adapters`` adapters with
``max_loras`` that many, so every step runs them all. Reported: output tokens/s and the ratio to
the engine without LoRA (which runs its fused decode paths: folded norms, GEMV layers, off with
LoRA enabled; CUDA graphs run either way). ``--compare-gemms`` (GPU) adds the adapters' runs
with the shrink / mask / expand GEMMs instead of the Triton expand kernel
(``BATON_LORA_EXPAND_KERNEL=0``), in the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from baton_engine.config import EngineConfig, ModelConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.lora import TARGETS, LoRARequest, part_shape
from baton_engine.model_loader import resolve_model
from baton_engine.runner import model_runner
from baton_engine.sampling_params import SamplingParams

CONFIGS = Path(__file__).parent / "configs"
SHAPES = {"qwen": CONFIGS / "qwen2.5-0.5b", "llama": CONFIGS / "llama-3.1-8b"}


def random_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int) -> Path:
    """A PEFT adapter folder for ``cfg`` with random weights on every projection."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for part in TARGETS:
            in_f, out_f = part_shape(cfg, part)
            owner = "self_attn" if part in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{owner}.{part}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * 0.01
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
              "target_modules": list(TARGETS)}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def run(
    args: argparse.Namespace,
    model: str,
    prompts: list[list[int]],
    loras: list[LoRARequest | None],
    enable_lora: bool,
    expand_kernel: bool = True,
) -> float:
    """Seconds to generate every prompt (after a warm-up batch) on a fresh engine."""
    model_runner.LORA_EXPAND_KERNEL = expand_kernel
    kwargs: dict[str, Any] = dict(
        model=model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
    )
    if args.shape is not None:
        kwargs["load_format"] = "dummy"
    if args.device.startswith("cuda"):
        kwargs["gpu_memory_utilization"] = 0.8
    if enable_lora:
        kwargs.update(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
    core = EngineCore(EngineConfig(**kwargs))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def generate(core: EngineCore, batch: list[list[int]], tag: str) -> None:
        for i, ids in enumerate(batch):
            core.add_request(f"{tag}{i}", ids, params, lora_request=loras[i % len(loras)])
        for _ in range(len(batch) * (args.output_len + args.input_len) + 100):  # bounded
            if not core.has_unfinished_requests():
                return
            core.step()
        raise RuntimeError("requests still unfinished")

    generate(core, prompts[: min(8, len(prompts))], "w")  # warm-up: kernels, allocator, adapters
    sync(args.device)
    start = time.perf_counter()
    generate(core, prompts, "r")
    sync(args.device)
    elapsed = time.perf_counter() - start
    del core
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return elapsed


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", nargs="?", default=None, help="model folder (default: SmolLM2)")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="dummy weights")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--output-json", type=Path, default=None)
    p.add_argument("--compare-gemms", action="store_true", help="also without the kernel")
    p.add_argument("--log", action="store_true", help="the engines' logs (graphs, KV cache)")
    args = p.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    model = str(SHAPES[args.shape]) if args.shape else str(resolve_model(args.model))
    cfg = ModelConfig.from_path(Path(model))
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, cfg.vocab_size, (args.num_prompts, args.input_len), generator=g)
    prompt_list = prompts.tolist()
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [
            LoRARequest(f"a{i}", i + 1, str(random_adapter(Path(tmp) / f"a{i}", cfg, args.rank, i)))
            for i in range(args.num_adapters)
        ]
        mixed = f"{args.num_adapters} adapters mixed"
        variants: list[tuple[str, list[LoRARequest | None], bool, bool]] = [
            ("no LoRA", [None], False, True),
            ("LoRA on, base model", [None], True, True),
            ("1 adapter", adapters[:1], True, True),
            (mixed, list(adapters), True, True),
        ]
        if args.compare_gemms:
            variants += [
                ("1 adapter, GEMMs", adapters[:1], True, False),
                (f"{mixed}, GEMMs", list(adapters), True, False),
            ]
        rows = [
            (name, run(args, model, prompt_list, loras, on, kernel))
            for name, loras, on, kernel in variants
        ]
    num_out = args.num_prompts * args.output_len
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"\n{args.num_prompts} prompts x {args.input_len} in / {args.output_len} out, rank "
        f"{args.rank}, {model}, {device}"
    )
    print(f"{'configuration':<30} {'output tok/s':>12} {'vs no LoRA':>10}")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device}
    for name, seconds in rows:
        ratio = rows[0][1] / seconds
        print(f"{name:<30} {num_out / seconds:>12.0f} {ratio:>9.2f}x")
        report[name] = {"output_tok_s": num_out / seconds, "vs_no_lora": ratio}
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

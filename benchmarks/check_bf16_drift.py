"""How far the first-step logprobs of bf16 runs drift from a float32 reference: Baton with the
torch ops, Baton with the fused Triton kernels, and Hugging Face transformers, on the same
random-init Qwen2.5-0.5B-shaped model (as bench_gpu_engine's check, float32 as the referee).

    TRITON_INTERPRET=1 python benchmarks/check_bf16_drift.py --device cpu   # kernels interpreted
    python benchmarks/check_bf16_drift.py                                   # on a GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu_engine import SHAPES, engine, random_prompts

from baton_engine.sampling_params import SamplingParams


def baton_logprobs(
    model: Path, args: argparse.Namespace, prompts: list[list[int]], fused: bool
) -> dict[int, tuple[list[int], list[float]]]:
    core = engine(model, args, load_format="auto", max_num_seqs=len(prompts), dtype="bfloat16")
    if fused:
        core.runner.model.use_fused_kernels()
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    got = {}
    while core.has_unfinished_requests():
        for o in core.step():
            assert o.new_logprobs is not None
            lp = o.new_logprobs[0]
            got[int(o.req_id)] = (lp.token_ids[1:], lp.logprobs[1:])
    return got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--output-len", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=4)
    args = p.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(SHAPES["qwen"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    with torch.no_grad():  # as bench_gpu_engine: a larger init, so the distribution is not flat
        for name, param in hf.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.05)
    prompts = random_prompts(args.num_prompts, args.prompt_len, cfg.vocab_size, seed=2)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp, safe_serialization=True)
        runs = {
            "baton bf16, torch ops": baton_logprobs(Path(tmp), args, prompts, fused=False),
            "baton bf16, fused kernels": baton_logprobs(Path(tmp), args, prompts, fused=True),
        }
    hf = hf.to(args.device).eval()
    with torch.no_grad():
        ids = torch.tensor(prompts, device=args.device)
        hf_bf16 = hf(ids).logits[:, -1].float().log_softmax(-1)
        ref = hf.float()(ids).logits[:, -1].log_softmax(-1)
    hf_run = {}
    for i in range(len(prompts)):
        top = ref[i].topk(20).indices.tolist()
        hf_run[i] = (top, hf_bf16[i, top].tolist())
    runs["transformers bf16"] = hf_run
    print("max |logprob - float32 reference| over each run's top 20, and argmax agreement:")
    for name, run in runs.items():
        worst, top1 = 0.0, 0
        for i, (ids_, values) in run.items():
            want = ref[i, torch.tensor(ids_, device=args.device)]
            worst = max(worst, float((torch.tensor(values, device=args.device) - want).abs().max()))
            top1 += (
                int(ids_[0] == int(ref[i].argmax()))
                if name != "transformers bf16"
                else int(int(hf_bf16[i].argmax()) == int(ref[i].argmax()))
            )
        print(f"  {name:28} {worst:.4f}   argmax {top1}/{len(run)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

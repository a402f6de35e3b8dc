"""The sampler's time per step, and its parts: the top-p cut and the draw.

    python benchmarks/bench_sampler.py [--vocab 49152] [--rows 16,64] [--iters 30] [--real]
        [--device cuda]

For each row count: ``Sampler`` on float32 logits, all greedy, all at temperature 1 and at
temperature 1 with top-p 0.9; the top-p cut alone; one token per row from the probabilities
(the inverse CDF on CPUs, the exponential race on GPUs), unseeded and every row seeded, and
``Sampler`` at temperature 1 with every row seeded; on GPUs each by the Triton kernel and by
torch's ops (``sampler.RACE_KERNEL``). Median milliseconds. The random
logits (``randn * 3``) are a flat case: a 0.9 nucleus holds ~2,000 of 49,152 tokens.

``--real`` adds the top-p cut alone on the default model's own logits: 16 chat prompts decoded
together at temperature 1 (64 tokens each), every 16-row step's logits kept, then
``apply_top_k_top_p`` (``topk`` first, rows sorted only when their nucleus is wider) against
sorting every row, at top-p 0.9 and 0.95, with the nucleus sizes met. Mean milliseconds a step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from baton_engine import sampler as sampler_module
from baton_engine.sampler import Sampler, SamplingMetadata
from baton_engine.sampling_params import SamplingParams

_CHATS = (
    "Write a short story about a dragon.",
    "Explain how a CPU cache works.",
    "What is the capital of France? Answer and then discuss its history.",
    "List ten fruits and describe each.",
    "Translate 'good morning' into five languages.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a poem about the sea.",
    "Describe the rules of chess.",
    "What are black holes?",
    "Write a haiku about autumn.",
    "Summarise the plot of Hamlet.",
    "How do vaccines work?",
    "Tell me a joke about programmers.",
    "Plan a three-day trip to Rome.",
    "What is machine learning?",
)


def median_ms(fn: Callable[[], object], iters: int, device: str = "cpu") -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    fn()
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_rows(
    sampler: Sampler, rows: int, vocab: int, iters: int, device: str = "cpu"
) -> list[tuple[str, float]]:
    logits = torch.randn(rows, vocab, device=device) * 3
    cases = {
        "Sampler, greedy": SamplingParams(temperature=0.0),
        "Sampler, temperature 1": SamplingParams(temperature=1.0),
        "Sampler, temperature 1, top-p": SamplingParams(temperature=1.0, top_p=0.9),
    }
    out = []
    for name, params in cases.items():
        meta = SamplingMetadata.from_params(
            [params] * rows, [[]] * rows, [[]] * rows, {}, device=device
        )
        out.append((name, median_ms(lambda meta=meta: sampler(logits, meta), iters, device)))
    top_p = torch.full((rows,), 0.9, device=device)
    cuts = [("top-p 0.9 cut, sorted", sampler_module._apply_top_k_top_p_sorted)]
    if device == "cpu":  # (the CPU path: numpy's sort for the rows topk does not settle)
        cuts.append(("top-p 0.9 cut, topk first", sampler_module._apply_top_k_top_p_topk_first))
    else:  # (the GPU path: the Triton search, no sort)
        cuts.append(("top-p 0.9 cut, search", sampler_module.apply_top_k_top_p))
    for name, cut in cuts:
        out.append(
            (name, median_ms(lambda cut=cut: cut(logits.clone(), None, top_p), iters, device))
        )
    probs = logits.softmax(dim=1)
    seeds = {i: sampler_module.draw_seed(i, 0) for i in range(rows)}  # every row seeded
    # GPUs: the Triton kernel, then torch's exponential_, division and argmax (RACE_KERNEL)
    for suffix, kernel in ((" [kernel]", True), (" [torch]", False)):
        if device == "cpu" and not kernel:
            continue
        sampler_module.RACE_KERNEL = kernel
        seeded = SamplingMetadata.from_params(
            [SamplingParams(temperature=1.0, seed=1)] * rows,
            [[]] * rows,
            [[]] * rows,
            seeds,
            device=device,
        )
        cases = [
            ("draw, rows seeded", lambda: draw(probs.clone(), seeds)),
            ("Sampler, T 1, rows seeded", lambda md=seeded: sampler(logits, md)),
        ]
        if not kernel or device == "cpu":  # (rows without seeds: torch's ops on GPUs)
            cases.insert(0, ("draw", lambda: draw(probs.clone(), {})))
        for name, fn in cases:
            out.append((name + (suffix if device != "cpu" else ""), median_ms(fn, iters, device)))
    sampler_module.RACE_KERNEL = True
    return out


def draw(probs: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
    """The sampler's draw on ``probs``' device: the exponential race on GPUs, the inverse CDF
    on CPUs."""
    return sampler_module.draw(probs, seeds)


def real_logits() -> list[torch.Tensor]:
    """Every 16-row step's processed logits from the default model decoding ``_CHATS``."""
    from baton_engine.llm import LLM

    kept: list[torch.Tensor] = []
    cut = sampler_module.apply_top_k_top_p

    def keep(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None):
        if logits.size(0) == len(_CHATS):
            kept.append(logits.clone())
        return cut(logits, top_k, top_p)

    sampler_module.apply_top_k_top_p = keep
    llm = LLM()
    try:
        tok = llm.get_tokenizer()
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True
            )
            for c in _CHATS
        ]
        llm.generate(chats, SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64, seed=1))
    finally:
        llm.shutdown()
        sampler_module.apply_top_k_top_p = cut
    return kept


def time_top_p(steps: list[torch.Tensor]) -> None:
    cuts = (
        ("topk first", sampler_module._apply_top_k_top_p_topk_first),
        ("sort every row", sampler_module._apply_top_k_top_p_sorted),
    )
    for p in (0.9, 0.95):
        top_p = torch.full((steps[0].size(0),), p)
        sizes = []
        for x in steps:
            probs = x.softmax(1).sort(dim=1, descending=True).values
            sizes += ((probs.cumsum(1) - probs) < p).sum(1).tolist()
        sizes.sort()
        n = len(sizes)
        print(
            f"top-p {p}: {len(steps)} steps, nucleus median {sizes[n // 2]}, "
            f"p90 {sizes[int(n * 0.9)]}, max {sizes[-1]}"
        )
        for name, cut in cuts:
            times = []
            for x in steps:
                y = x.clone()
                start = time.perf_counter()
                cut(y, None, top_p)
                times.append(time.perf_counter() - start)
            print(f"  {name:<16} {statistics.mean(times) * 1e3:8.2f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--rows", default="16,64")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--real", action="store_true", help="also time top-p on the model's logits")
    p.add_argument("--device", default="cpu", help="where the logits live (--real: CPU only)")
    args = p.parse_args()
    sampler = Sampler()
    print(f"{'rows':>5} {'case':<28} {'ms':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, ms in time_rows(sampler, rows, args.vocab, args.iters, args.device):
            print(f"{rows:>5} {name:<28} {ms:>8.2f}")
    if args.real:
        time_top_p(real_logits())


if __name__ == "__main__":
    main()

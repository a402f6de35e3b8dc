"""The ``baton`` command: ``generate``, ``bench``; services come with their own subcommands."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

DEMO_PROMPTS = [
    "Name the capital of France.",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is.",
    "Give me three tips for learning a new language.",
]


def _cmd_generate(args: argparse.Namespace) -> int:
    from baton_engine.arg_utils import engine_kwargs_from_args
    from baton_engine.llm import LLM
    from baton_engine.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    prompts = args.prompt or DEMO_PROMPTS
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"\n>>> {prompt}\n{out.outputs[0].text.strip()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from baton import __version__
    from baton_engine.arg_utils import add_engine_args

    parser = argparse.ArgumentParser(prog="baton", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate offline from a few prompts")
    gen.add_argument("model", nargs="?", default=None, help="model path (default: SmolLM2)")
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    from baton.bench import add_bench_parser

    add_bench_parser(sub, add_engine_args)
    # Services register their own subcommands (`baton serve|gateway|decode|...`).
    import importlib

    for module in (
        "baton.serve",
        "baton_gateway.cli",
        "baton_decode.cli",
        "baton_prefill.cli",
        "baton_kvstore.cli",
    ):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    args = build_parser().parse_args(argv)
    from baton_engine.errors import BatonError

    try:
        return int(args.func(args))
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

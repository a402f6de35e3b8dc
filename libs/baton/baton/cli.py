"""The ``baton`` command: ``generate``, ``bench``; services come with their own subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

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


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """vLLM's ``--config FILE``: the YAML file's keys (``max-model-len: 4096``; underscores
    too) as the subcommand's flags, before the command line's own, which win. A list gives
    several values, a mapping its JSON; ``true`` is the bare flag, ``false`` its ``--no-``
    form where the flag has one (else nothing). Raises InvalidRequestError for a file that is
    not a YAML mapping."""
    from baton_engine.errors import InvalidRequestError

    at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    if at is None or not argv:
        return argv
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            raise InvalidRequestError("--config needs a file")
        path, rest = argv[at + 1], argv[:at] + argv[at + 2 :]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[:at] + argv[at + 1 :]
    import yaml

    try:
        with open(path) as f:
            config: Any = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise InvalidRequestError(f"--config {path}: {e}") from None
    if not isinstance(config, dict):
        raise InvalidRequestError(f"--config {path}: not a YAML mapping of flags")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices.get(rest[0]) if rest else None
    known = {s: a for a in (command or parser)._actions for s in a.option_strings}
    flags: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            no = "--no-" + flag[2:]
            flags += [no] if no in known else []
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif value is not None:
            flags += [flag, str(value)]
    return [*rest[:1], *flags, *rest[1:]]


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from baton_engine.errors import BatonError

    parser = build_parser()
    try:
        argv = with_config_file(list(sys.argv[1:] if argv is None else argv), parser)
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)

    try:
        return int(args.func(args))
    except BatonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark against a running OpenAI-compatible server (``baton serve``, vLLM, ...).

    python benchmarks/bench_serve.py --base-url http://127.0.0.1:8000 --ignore-eos \
        --num-prompts 64 --random-input-len 128 --random-output-len 128 --max-concurrency 16

Same as ``baton bench serve``; see ``baton bench serve --help``.
"""

from __future__ import annotations

import sys

from baton.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))

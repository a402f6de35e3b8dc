"""Offline throughput of the engine vs Hugging Face static batching, in the same run.

    python benchmarks/throughput.py [MODEL] [--dtype bfloat16] [--num-prompts 64] ...

Same as ``baton bench throughput``; see ``baton bench throughput --help``.
"""

from __future__ import annotations

import sys

from baton.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *sys.argv[1:]]))

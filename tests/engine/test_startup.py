"""An engine's start-up imports no more of torch than it runs: building the model on "meta"
without random initialization (``model_runner._no_init``) keeps torch's Python references, and
the ~0.5-1 s import of torch._dynamo behind their first use, out of every worker's start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from baton_engine.runner import model_runner

_PROBE = """
import sys
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams
core = EngineCore(EngineConfig(model=sys.argv[1], max_model_len=256, kv_cache_memory=16 << 20))
core.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0.8, seed=1, max_tokens=3))
while core.has_unfinished_requests():
    core.step()
print("torch._dynamo" in sys.modules)
"""


def test_an_engine_starts_and_runs_without_importing_dynamo(default_model_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, str(default_model_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]


def test_no_init_skips_initialization_on_meta_only_and_restores_it() -> None:
    init = torch.nn.init.kaiming_uniform_
    weight = torch.zeros(4, 4)
    meta = torch.empty(4, 4, device="meta")
    with pytest.raises(RuntimeError), model_runner._no_init():
        assert torch.nn.init.kaiming_uniform_(meta) is meta  # skipped
        torch.nn.init.kaiming_uniform_(weight)  # (another thread's tensor, say): initialized
        assert weight.any()
        assert torch.nn.Linear(4, 4).weight.any()
        raise RuntimeError
    assert torch.nn.init.kaiming_uniform_ is init  # restored, even after an error

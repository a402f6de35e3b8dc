"""vLLM's profiling (``profiler_config``, ``LLM.start_profile`` / ``stop_profile``) on the CPU:
the steps between a start and a stop land in a Chrome trace in the profiler's folder, each step
annotated, with a table of the ops; ``delay_iterations`` and ``max_iterations`` bound what is
recorded. Bad configurations and calls are clear errors. (Two ranks: a trace each,
``test_tensor_parallel.py``; the servers' endpoints: ``tests/integration/test_serve.py``.)"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from baton import LLM, SamplingParams
from baton_engine.config import EngineConfig
from baton_engine.errors import InvalidRequestError
from baton_engine.profiler import ProfilerConfig

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(model_dir: Path, profiler_config: dict[str, Any] | None) -> LLM:
    return LLM(
        str(model_dir),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory=8 << 20,
        profiler_config=profiler_config,
    )


def steps_in(trace: Path) -> int:
    """The engine steps a trace recorded."""
    data = trace.read_bytes()
    events = json.loads(gzip.decompress(data) if trace.suffix == ".gz" else data)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # (the ops inside)
    return sum(1 for e in events if e.get("name") == "engine_step" and e.get("ph") == "X")


def test_the_configuration_is_vllms(monkeypatch: pytest.MonkeyPatch) -> None:
    config = ProfilerConfig.parse('{"profiler": "torch", "torch_profiler_dir": "~/traces"}')
    assert config.folder == str(Path("~/traces").expanduser())
    assert ProfilerConfig.parse(None).profiler is None
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/tmp/vllm-traces")  # (vLLM's older form)
    assert ProfilerConfig.parse(None).torch_profiler_dir == "/tmp/vllm-traces"
    for bad, message in [
        ('{"profiler": "torch"}', "torch_profiler_dir must be set"),
        ('{"torch_profiler_dir": "/tmp/x"}', "applies to profiler 'torch' only"),
        ('{"profiler": "nsys"}', "'nsys' is not supported"),
        ('{"profiler": "torch", "torch_profiler_dir": "/t", "depth": 2}', r"\['depth'\]"),
        ('{"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": "2"}', "whole"),
        ('{"profiler": "torch", "torch_profiler_dir": "/t", "active_iterations": 0}', "small"),
        ("[1]", "JSON object"),
        ("{", "not valid JSON"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            ProfilerConfig.parse(bad)
    with pytest.raises(InvalidRequestError, match="'cuda' needs a GPU"):
        EngineConfig(profiler_config={"profiler": "cuda"}).validate()


def test_the_steps_between_start_and_stop_land_in_a_trace(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Every step of a generation between ``start_profile`` and ``stop_profile`` is in one
    gzipped Chrome trace named after the prefix (vLLM's defaults: Python stacks too); nothing
    is recorded outside; a stop without a start, or a second start, is an error."""
    folder = tmp_path / "traces"
    llm = make_llm(default_model_dir, {"profiler": "torch", "torch_profiler_dir": str(folder)})
    llm.generate(["Warm up"], PARAMS)
    with pytest.raises(InvalidRequestError, match="not running"):
        llm.stop_profile()
    llm.start_profile("unit")
    with pytest.raises(InvalidRequestError, match="running already"):
        llm.start_profile()
    llm.generate(["Hello, my name is", "The capital of France is"], PARAMS)
    llm.stop_profile()
    llm.generate(["Not recorded"], PARAMS)
    (trace,) = folder.glob("unit-rank0-*.pt.trace.json.gz")
    assert PARAMS.max_tokens <= steps_in(trace) <= PARAMS.max_tokens + 2
    assert len(list(folder.glob("*.pt.trace.json*"))) == 1


def test_delay_and_max_iterations_bound_the_recording(
    default_model_dir: Path, tmp_path: Path
) -> None:
    profiler = {
        "profiler": "torch",
        "torch_profiler_dir": str(tmp_path),
        "torch_profiler_use_gzip": False,
        "torch_profiler_with_stack": False,
        "delay_iterations": 2,
        "max_iterations": 3,
    }
    llm = make_llm(default_model_dir, profiler)
    llm.start_profile()
    llm.generate(["Hello, my name is"], PARAMS)  # (8 steps: the trace is written at the 5th)
    (trace,) = tmp_path.glob("rank0-*.pt.trace.json")
    llm.stop_profile()
    assert steps_in(trace) == 3
    assert "Self CPU" in (tmp_path / "profiler_out_0.txt").read_text()  # (the ops' table)


def test_profiling_off_is_a_clear_error(default_model_dir: Path) -> None:
    llm = make_llm(default_model_dir, None)
    with pytest.raises(InvalidRequestError, match="profiling is off"):
        llm.start_profile()

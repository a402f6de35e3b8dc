"""The decode/prefill worker's engine thread: it builds the engine core and steps it, so that the
worker's torch work runs on one thread (one libgomp thread pool, see ``EngineThread``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from baton_decode.engine_loop import EngineLoop, EngineThread
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.errors import ModelLoadError
from baton_engine.sampling_params import SamplingParams


def test_worker_engine_is_built_and_stepped_on_one_thread(default_model_dir: Path) -> None:
    seen: dict[str, set[int]] = {"build": set(), "step": set()}

    def build() -> EngineCore:
        seen["build"].add(threading.get_ident())
        core = EngineCore(
            EngineConfig(model=str(default_model_dir), max_model_len=256, kv_cache_memory=32 << 20)
        )
        step = core.step

        def recorded_step() -> list:  # type: ignore[type-arg]
            seen["step"].add(threading.get_ident())
            return step()

        core.step = recorded_step  # type: ignore[method-assign]
        return core

    async def serve_one() -> list[int]:
        engine_thread = EngineThread(build)
        core = engine_thread.core()
        engine = EngineLoop(core, asyncio.get_running_loop(), max_pending=4, thread=engine_thread)
        engine.start()
        stream = engine.add_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=5))
        tokens: list[int] = []
        while True:
            outputs = await stream.next_batch()
            tokens += [t for out in outputs for t in out.new_token_ids]
            if outputs[-1].finish_reason is not None:
                break
        engine.shutdown()
        assert not engine_thread.thread.is_alive()
        return tokens

    tokens = asyncio.run(serve_one())
    assert len(tokens) == 5
    assert len(seen["build"]) == 1 and seen["step"] == seen["build"]
    assert threading.get_ident() not in seen["build"]


def test_engine_thread_raises_the_build_error_and_ends() -> None:
    def build() -> EngineCore:
        raise ModelLoadError("no such model: /nowhere")

    engine_thread = EngineThread(build)
    with pytest.raises(ModelLoadError, match="/nowhere"):
        engine_thread.core()
    engine_thread.thread.join(5)
    assert not engine_thread.thread.is_alive()


def test_engine_thread_cancelled_before_running_ends() -> None:
    engine_thread = EngineThread(lambda: None)  # type: ignore[arg-type,return-value]
    engine_thread.cancel()
    engine_thread.thread.join(5)
    assert not engine_thread.thread.is_alive()

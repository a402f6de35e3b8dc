"""vLLM's profiling of the engine (``--profiler-config``, ``LLM.start_profile`` /
``stop_profile``, the servers' ``POST /start_profile`` / ``/stop_profile``).

With ``{"profiler": "torch", "torch_profiler_dir": DIR}`` every engine (every tensor-parallel
rank) records ``torch.profiler`` traces of its steps between a start and a stop, each step
annotated with its number and tokens, and writes one Chrome trace a rank into ``DIR``
(``{name}.{time_ns}.pt.trace.json.gz``, viewable in Perfetto), plus, with
``torch_profiler_dump_cuda_time_total``, a table of the ops by their own time
(``profiler_out_{rank}.txt``). ``delay_iterations`` steps pass before the recording starts,
``max_iterations`` (0: no limit) end it early, and ``warmup_iterations`` / ``active_iterations``
/ ``wait_iterations`` record with torch's schedule. ``{"profiler": "cuda"}`` brackets the
steps with ``cudaProfilerStart`` / ``cudaProfilerStop`` instead, for Nsight Systems'
``--capture-range=cudaProfilerApi``. vLLM's older ``VLLM_TORCH_PROFILER_DIR`` (or
``BATON_TORCH_PROFILER_DIR``) stands for the torch profiler into that folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from baton_engine.errors import InvalidRequestError
from baton_engine.json_args import json_object

if TYPE_CHECKING:  # (the gateway reads ProfilerConfig's flags without torch installed)
    import torch

logger = logging.getLogger(__name__)

PROFILERS = ("torch", "cuda")
_DIR_ENV = ("BATON_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")


@dataclass(frozen=True)
class ProfilerConfig:
    """vLLM's ``ProfilerConfig`` (its keys and defaults)."""

    profiler: str | None = None  # one of PROFILERS; None: no profiling
    torch_profiler_dir: str = ""
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    # vLLM's, for its front end's own trace: the gateway is never profiled here
    ignore_frontend: bool = False
    delay_iterations: int = 0
    max_iterations: int = 0
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> ProfilerConfig:
        """vLLM's JSON object (or a dict offline); None: the folder of
        ``$VLLM_TORCH_PROFILER_DIR`` (or ``$BATON_TORCH_PROFILER_DIR``) if set, else no
        profiling. ``InvalidRequestError`` for an unknown key or a bad value."""
        if value is None or (isinstance(value, str) and not value.strip()):
            folder = next((os.environ[k] for k in _DIR_ENV if os.environ.get(k)), "")
            value = {"profiler": "torch", "torch_profiler_dir": folder} if folder else {}
        known = {f.name: f for f in fields(cls)}
        value = json_object("profiler_config", value, known)
        for key, given in value.items():
            default = known[key].default
            kind = type(default) if default is not None else str
            if type(given) is not kind and not (key == "profiler" and given is None):
                what = {int: "a whole number", bool: "true or false"}.get(kind, "a string")
                raise InvalidRequestError(f"profiler_config: {key} must be {what}, got {given!r}")
            if isinstance(given, int) and given < (1 if key == "active_iterations" else 0):
                raise InvalidRequestError(f"profiler_config: {key} is too small: {given}")
        config = cls(**value)
        if config.profiler not in (None, *PROFILERS):
            raise InvalidRequestError(
                f"profiler_config: profiler {config.profiler!r} is not supported: one of "
                f"{', '.join(PROFILERS)}"
            )
        if config.profiler == "torch" and not config.torch_profiler_dir:
            raise InvalidRequestError(
                "profiler_config: torch_profiler_dir must be set when profiler is 'torch'"
            )
        if config.torch_profiler_dir and config.profiler != "torch":
            raise InvalidRequestError(
                "profiler_config: torch_profiler_dir applies to profiler 'torch' only"
            )
        return config

    @property
    def folder(self) -> str:
        return os.path.abspath(os.path.expanduser(self.torch_profiler_dir))


class StepProfiler:
    """One engine's (one rank's) recording between ``start`` and ``stop``, counted in steps
    (``step`` wraps each)."""

    def __init__(self, config: ProfilerConfig, device: torch.device, rank: int = 0) -> None:
        assert config.profiler is not None
        if config.profiler == "cuda" and device.type != "cuda":
            raise InvalidRequestError("profiler 'cuda' needs a GPU (the engine runs on a CPU)")
        self.config = config
        self.device = device
        self.rank = rank
        self.running = False  # between start and stop
        self._name = ""
        self._steps = 0  # steps since start
        self._recording = False  # (past delay_iterations, before max_iterations)
        self._done = False  # max_iterations recorded: nothing more until the next start
        self._torch: torch.profiler.profile | None = None

    def start(self, prefix: str | None = None) -> None:
        if self.running:
            raise InvalidRequestError("the profiler is running already: stop it first")
        self.running, self._steps, self._done = True, 0, False
        self._name = f"{prefix + '-' if prefix else ''}rank{self.rank}-{os.getpid()}"
        if self.config.delay_iterations == 0:
            self._begin()
        logger.info("profiler started (%s)", self.config.profiler)

    def stop(self) -> None:
        if not self.running:
            raise InvalidRequestError("the profiler is not running: start it first")
        self.running = False
        self._end()
        logger.info("profiler stopped after %d steps", self._steps)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """One engine step (``what``: its annotation in the trace)."""
        import torch

        config = self.config
        if not self._recording and not self._done and self._steps >= config.delay_iterations:
            self._begin()
        self._steps += 1
        if not self._recording:
            yield
            return
        with torch.profiler.record_function(what):
            yield
        if self._torch is not None:
            self._torch.step()
        if config.max_iterations and self._steps >= config.delay_iterations + config.max_iterations:
            self._end()
            self._done = True

    def _begin(self) -> None:
        import torch

        self._recording = True
        config = self.config
        if config.profiler == "cuda":
            torch.cuda.profiler.start()  # type: ignore[no-untyped-call]
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = None
        if config.warmup_iterations:
            schedule = torch.profiler.schedule(
                wait=config.wait_iterations,
                warmup=config.warmup_iterations,
                active=config.active_iterations,
                repeat=1,
            )
        os.makedirs(config.folder, exist_ok=True)
        self._torch = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                config.folder, worker_name=self._name, use_gzip=config.torch_profiler_use_gzip
            ),
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
        )
        self._torch.start()

    def _end(self) -> None:
        """Stop recording and write what was recorded (once)."""
        import torch

        if not self._recording:
            return
        self._recording = False
        config = self.config
        if config.profiler == "cuda":
            torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]
            return
        prof, self._torch = self._torch, None
        assert prof is not None
        prof.stop()  # (writes the trace: on_trace_ready)
        if config.torch_profiler_dump_cuda_time_total:
            key = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            try:
                table = prof.key_averages().table(sort_by=key, row_limit=-1)
            except UnicodeDecodeError as e:  # (torch's parse of Python frames, at times)
                logger.warning(
                    "no table of the ops (%s); the trace is written. "
                    '"torch_profiler_with_stack": false avoids this',
                    e,
                )
                return
            path = os.path.join(config.folder, f"profiler_out_{self.rank}.txt")
            with open(path, "w") as f:
                f.write(table)

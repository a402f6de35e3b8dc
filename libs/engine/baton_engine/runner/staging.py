"""Host-to-device copies of a step's inputs that never wait for the device.

A CUDA copy from pageable host memory may synchronise with the stream (the driver stages it
through pinned memory of its own), which would make the host wait for the step still running
before it can launch the next one: async scheduling would overlap nothing. So the runner writes
each step's small inputs (token ids, positions, block tables, slots, lengths, row indices) into
pinned buffers and copies from there. Two buffers alternate, one per step: step k+1's inputs are
written while step k's copies may still be queued on the stream. Before a buffer is reused, the
host waits for the event recorded after the step that last used it (``step_launched``): usually
long done, since the engine waited for that step's tokens, but a step that samples nothing (a
chunk in the middle of a long prompt) is not waited for, and the host could otherwise lap the
stream.
On a CPU the inputs are plain tensors over the arrays (no copy).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_ALIGN = 64  # bytes; each staged array starts on its own cache line


class InputStaging:
    def __init__(self, device: torch.device, capacity_bytes: int = 1 << 20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: list[torch.Tensor] = []
        if self.pinned:
            self._buffers = [
                torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
            ]
        self._current = 0
        self._offset = 0
        # per buffer: pinned one-offs of an oversized step, and the event after its last step
        self._overflow: list[list[torch.Tensor]] = [[], []]
        self._used: list[torch.cuda.Event | None] = [None, None]

    def next_step(self) -> None:
        """Start a step's inputs: switch to the other buffer, once its last step's copies ran."""
        self._current ^= 1
        self._offset = 0
        used = self._used[self._current]
        if used is not None:
            used.synchronize()
            self._used[self._current] = None
        self._overflow[self._current].clear()

    def step_launched(self) -> None:
        """Mark the current buffer in use until the work queued so far has run."""
        if self.pinned:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            self._used[self._current] = event

    def host(self, data: np.ndarray | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``data`` as a CPU tensor of ``dtype`` to copy to the device from (pinned on GPUs;
        valid until the step after next starts)."""
        array = torch.as_tensor(np.asarray(data), dtype=dtype)
        if not self.pinned:
            return array
        nbytes = array.numel() * array.element_size()
        start = -(self._offset // -_ALIGN) * _ALIGN
        buffer = self._buffers[self._current]
        if start + nbytes > buffer.numel():
            staged = torch.empty_like(array, pin_memory=True)
            self._overflow[self._current].append(staged)
        else:
            self._offset = start + nbytes
            staged = buffer[start : start + nbytes].view(dtype).view(array.shape)
        staged.copy_(array)
        return staged

    def to_device(self, data: np.ndarray | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``data`` on the device, copied without waiting for the stream."""
        return self.host(data, dtype).to(self.device, non_blocking=True)

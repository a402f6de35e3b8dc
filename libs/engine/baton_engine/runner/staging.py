"""Host-to-device copies of a step's inputs that never wait for the device.

A CUDA copy from pageable host memory may synchronise with the stream (the driver stages it
through pinned memory of its own), which would make the host wait for the step still running
before it can launch the next one: async scheduling would overlap nothing. So the runner writes
each step's small inputs (token ids, positions, block tables, slots, lengths, row indices) into
pinned buffers and copies from there. Two buffers alternate, one per step: step k+1's inputs are
written while step k's copies may still be queued behind step k-1 on the stream; the buffer step
k+1 reuses was last read by step k-1, which has finished by the time the host launches k+1
(the engine waits for step k-1's tokens first).
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
        self._overflow: list[torch.Tensor] = []  # pinned one-offs of an oversized step

    def next_step(self) -> None:
        """Start a step's inputs: switch to the other buffer."""
        self._current ^= 1
        self._offset = 0
        if self._current == 0:
            self._overflow.clear()  # read by steps that have finished by now

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
            self._overflow.append(staged)
        else:
            self._offset = start + nbytes
            staged = buffer[start : start + nbytes].view(dtype).view(array.shape)
        staged.copy_(array)
        return staged

    def to_device(self, data: np.ndarray | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """``data`` on the device, copied without waiting for the stream."""
        return self.host(data, dtype).to(self.device, non_blocking=True)

"""Decode-only steps through persistent device buffers, replayed from CUDA graphs.

A decode step of ``n`` requests is padded to the smallest captured batch size ``B >= n``. The
step's inputs (token ids, positions, block tables, sequence lengths, cache slots) are copied into
the first ``n`` rows of static buffers; the padding rows keep harmless values (slot -1: their
K/V is not written; length 1, block 0: they read one cached token and their output is dropped).
The graph of size ``B`` then replays the whole model forward with no host work per layer; the
only synchronisation of the step is the sampled token ids.

The attention backend must support capture (``TritonAttentionBackend``: with
``decode_seq_lens`` set and ``max_decode_blocks`` fixed at the longest context, its launches read
only device tensors). With ``capture=False`` the same padded path runs eagerly, which is how it is
tested on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from baton_kernels.attention import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self,
        forward: ForwardFn,
        *,
        max_batch_size: int,
        max_blocks_per_req: int,
        device: torch.device,
        capture: bool,
        capture_sizes: Sequence[int] = DEFAULT_CAPTURE_SIZES,
    ) -> None:
        self.forward = forward
        self.device = device
        self.capture = capture
        self.max_blocks_per_req = max_blocks_per_req
        self.sizes = sorted({s for s in capture_sizes if s <= max_batch_size} | {max_batch_size})
        self.max_batch_size = self.sizes[-1]
        n, dev = self.max_batch_size, device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.slot_block = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.slot_offset = torch.zeros(n, dtype=torch.int64, device=dev)
        self._metadata = {b: self._metadata_for(b) for b in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.num_steps: dict[int, int] = {}  # padded size -> decode steps run at it

    def _metadata_for(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_reqs=b,
            num_decodes=b,
            num_tokens=b,
            query_start_loc=list(range(b + 1)),
            seq_lens=[self.max_blocks_per_req] * b,  # not read: decode_seq_lens is set
            block_tables=self.block_tables[:b],
            slot_block=self.slot_block[:b],
            slot_offset=self.slot_offset[:b],
            decode_bias=None,
            max_decode_blocks=self.max_blocks_per_req,
            decode_seq_lens=self.seq_lens[:b],
        )

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode step of ``num_reqs`` runs at, or None (too large)."""
        for size in self.sizes:
            if size >= num_reqs:
                return size
        return None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture one graph per size, largest first (later ones reuse its memory pool)."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for b in reversed(self.sizes):
                md = self._metadata[b]
                for _ in range(2):  # warm up: autotuning, lazy init, allocator
                    self.forward(self.input_ids[:b], self.positions[:b], md)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(self.input_ids[:b], self.positions[:b], md)
                self._graphs[b], self._outputs[b] = graph, out
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %d..%d in %.1f s",
            len(self._graphs),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    @torch.inference_mode()
    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        block_tables: np.ndarray,
        slot_block: np.ndarray,
        slot_offset: np.ndarray,
        patch: Callable[[torch.Tensor], None] | None = None,
        host: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode step of ``n`` requests (row i: token
        ``input_ids[i]`` at ``positions[i]``; ``block_tables[i]`` its blocks). ``patch``, if
        given, may then overwrite input ids in the device buffer (``[n]``) before the replay.
        ``host`` makes the CPU tensors copied from (``torch.from_numpy`` or pinned staging)."""
        n = len(input_ids)
        b = self.padded_size(n)
        assert b is not None, f"decode batch {n} exceeds the largest captured size"
        self.num_steps[b] = self.num_steps.get(b, 0) + 1
        num_blocks = block_tables.shape[1]
        # One host-to-device copy per buffer (from ``host``'s tensors: pinned ones never wait
        # for the stream); the padding rows are reset each time.
        self.input_ids[:n].copy_(host(input_ids), non_blocking=True)
        self.positions[:n].copy_(host(positions), non_blocking=True)
        self.block_tables[:n, :num_blocks].copy_(host(block_tables), non_blocking=True)
        self.seq_lens[:n].copy_(host(positions + 1), non_blocking=True)
        self.slot_block[:n].copy_(host(slot_block), non_blocking=True)
        self.slot_offset[:n].copy_(host(slot_offset), non_blocking=True)
        if b > n:
            self.seq_lens[n:b].fill_(1)
            self.slot_block[n:b].fill_(-1)
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
        if patch is not None:
            patch(self.input_ids[:n])
        graph = self._graphs.get(b)
        if graph is None:  # not captured (eager mode, CPU tests)
            return self.forward(self.input_ids[:b], self.positions[:b], self._metadata[b])[:n]
        graph.replay()
        return self._outputs[b][:n]

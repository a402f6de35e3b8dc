"""Steps through persistent device buffers, replayed from CUDA graphs.

``DecodeGraphs``: decode-only steps, the whole forward in one graph per batch size.

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

A ``switch`` (optional, both classes) doubles the graphs: each is captured once with
``switch(False)`` and once with ``switch(True)``, and a step replays the set its ``switch_on``
names. The runner's LoRA adapters use it: steps with an adapter replay graphs that compute the
adapters' deltas, base-model steps graphs that skip them.

``PieceGraphs``: every other step (prompt chunks, mixed batches), replayed piecewise. The
attention of a prompt step depends on how its tokens split into requests, so it runs eagerly;
everything between two attentions (o_proj, the MLP, the norms, the next qkv projection) is one
graph per padded token count. An eager prompt step of a 24-layer model launches ~300 kernels
from Python; on the H200's host that took ~21 ms, longer than the kernels of an 8,192-token step
(~12.4 ms), so those steps were bound by the host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from baton_kernels.attention import AttentionBackend, AttentionMetadata, KVCacheView

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 256, then every 16.
DEFAULT_CAPTURE_SIZES = (1, 2, 4, *range(8, 257, 8), *range(272, 513, 16))

ForwardFn = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
Switch = Callable[[bool], object]


# Steps of more tokens run eagerly: their kernels outlast the host's launches (an 8,192-token
# step of Qwen2.5-0.5B was ~12.7 ms of kernels on an H200), and graphs for them would hold
# memory for their activations.
PIECE_MAX_TOKENS = 8192


def piece_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts that steps are padded to, up to ``max_tokens`` (at most
    ``PIECE_MAX_TOKENS``): powers of two up to 512, then every 512 (at most ~6% padding
    above 8,192 - 512 tokens), and the largest itself."""
    top = min(max_tokens, PIECE_MAX_TOKENS)
    sizes = {16, 32, 64, 128, 256, *range(512, top, 512), top}
    return sorted(s for s in sizes if s <= top)


def _on_side_stream(
    capture: Callable[[Any, torch.cuda.Stream, bool], None], switch: Switch | None
) -> None:
    """Run ``capture(pool, stream, on)``, which captures graphs on ``stream`` into the one
    memory pool ``pool``, on a side stream (capture cannot run on the default stream); then
    wait. With a ``switch``, twice: after ``switch(False)`` and after ``switch(True)``; the
    switch is left off."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for on in (False, True) if switch is not None else (False,):
            if switch is not None:
                switch(on)
            capture(pool, stream, on)
        if switch is not None:
            switch(False)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


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
        switch: Switch | None = None,
    ) -> None:
        self.forward = forward
        self.device = device
        self.capture = capture
        self.switch = switch
        self.max_blocks_per_req = max_blocks_per_req
        self.sizes = sorted({s for s in capture_sizes if s <= max_batch_size} | {max_batch_size})
        self.max_batch_size = self.sizes[-1]
        n, dev = self.max_batch_size, device
        # The per-row inputs are the rows of one buffer, which a step fills with one copy:
        # input ids, positions, sequence lengths, slot blocks, slot offsets.
        self.row_inputs = torch.zeros((5, n), dtype=torch.int64, device=dev)
        self._row_padding = np.array([[0], [0], [1], [-1], [0]], dtype=np.int64)
        self.row_inputs.copy_(torch.from_numpy(self._row_padding).expand(5, n))
        rows = self.row_inputs.unbind(0)
        self.input_ids, self.positions, self.seq_lens, self.slot_block, self.slot_offset = rows
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=torch.int64, device=dev)
        self._metadata = {b: self._metadata_for(b) for b in self.sizes}
        # (switch on, padded size) -> graph, its output
        self._graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[bool, int], torch.Tensor] = {}
        self.num_steps: dict[int, int] = {}  # padded size -> decode steps run at it
        self.replays = {False: 0, True: 0}  # switch position -> steps replayed from graphs

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
        """Capture one graph per size (and switch position), largest first (later ones reuse
        its memory pool)."""
        if not self.capture:
            return
        start = time.perf_counter()

        def capture(pool: Any, stream: torch.cuda.Stream, on: bool) -> None:
            for b in reversed(self.sizes):
                md = self._metadata[b]
                for _ in range(2):  # warm up: autotuning, lazy init, allocator
                    self.forward(self.input_ids[:b], self.positions[:b], md)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = self.forward(self.input_ids[:b], self.positions[:b], md)
                self._graphs[on, b], self._outputs[on, b] = graph, out

        _on_side_stream(capture, self.switch)
        # A graph's first replay also uploads it to the device, which cost the host ~0.4 ms
        # more in the first step of each batch size on the H200 (the first full-batch step of
        # a run and each of its last steps, where finished requests shrink the batch: Qwen
        # 256, benchmarks/device/step_timeline.py). Replay each once now, on the buffers'
        # padding rows (length 1, no K/V written).
        for graph in self._graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode batch sizes %d..%d in %.1f s",
            len(self._graphs),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Destroy the captured graphs (steps then run eagerly through the same buffers)."""
        for graph in self._graphs.values():
            graph.reset()
        self._graphs.clear()
        self._outputs.clear()

    @torch.inference_mode()
    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        block_tables: np.ndarray | None,
        slot_block: np.ndarray,
        slot_offset: np.ndarray,
        patch: Callable[[torch.Tensor], object] | None = None,
        host: Callable[[np.ndarray], torch.Tensor] = torch.from_numpy,
        switch_on: bool = False,
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode step of ``n`` requests (row i: token
        ``input_ids[i]`` at ``positions[i]``; ``block_tables[i]`` its blocks, None: the ones
        the last run copied, which cover these positions too). ``patch``, if
        given, may then overwrite input ids in the device buffer (``[n]``) before the replay.
        ``host`` makes the CPU tensors copied from (``torch.from_numpy`` or pinned staging).
        ``switch_on``: replay the graphs captured with the switch on (the caller has set it
        so for an eager step)."""
        n = len(input_ids)
        b = self.padded_size(n)
        assert b is not None, f"decode batch {n} exceeds the largest captured size"
        self.num_steps[b] = self.num_steps.get(b, 0) + 1
        # Two host-to-device copies (from ``host``'s tensors: pinned ones never wait for the
        # stream): the per-row inputs, padding rows reset, and the block tables. Each copy
        # costs the host more than its bytes do (~10-20 us on the H200's host).
        rows = np.empty((5, self.max_batch_size), dtype=np.int64)
        rows[:, n:] = self._row_padding
        rows[0, :n] = input_ids
        rows[1, :n] = positions
        np.add(positions, 1, out=rows[2, :n])
        rows[3, :n] = slot_block
        rows[4, :n] = slot_offset
        self.row_inputs.copy_(host(rows), non_blocking=True)
        if block_tables is not None:
            num_blocks = block_tables.shape[1]
            self.block_tables[:n, :num_blocks].copy_(host(block_tables), non_blocking=True)
        if patch is not None:
            patch(self.input_ids[:n])
        key = (switch_on and self.switch is not None, b)
        graph = self._graphs.get(key)
        if graph is None:  # not captured (eager mode, CPU tests)
            return self.forward(self.input_ids[:b], self.positions[:b], self._metadata[b])[:n]
        graph.replay()
        self.replays[key[0]] += 1
        return self._outputs[key][:n]


class PieceModel(Protocol):
    """What ``PieceGraphs`` needs of a model (``LlamaForCausalLM``)."""

    @property
    def num_pieces(self) -> int: ...

    def piece(
        self, i: int, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(
        self,
        i: int,
        rope: Any,
        qkv: torch.Tensor,
        kv_cache: KVCacheView,
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        stream: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rope_for(self, positions: torch.Tensor) -> Any: ...


class PieceGraphs:
    """A step of ``n`` tokens runs at the smallest size ``T >= n`` of ``sizes`` (larger steps
    run the model's eager forward): piece ``i``
    of the model reads its input from static buffers (the token ids; attention ``i - 1``'s
    output and the residual stream) and leaves its output in others (layer ``i``'s qkv, or the
    final hidden states), all ``[T, ...]`` views of buffers shared by every size. Attention
    ``i`` runs eagerly on the first ``n`` rows of the qkv buffer. The padding rows compute
    garbage that no row of the step reads: pieces are row-wise.

    The graphs of every size share one memory pool (a piece's intermediates are dead once it
    has run) and are captured before the KV cache is sized, so the pool's memory is counted
    as in use. With ``capture=False`` the pieces run eagerly through the same buffers (tests
    on CPU)."""

    def __init__(
        self,
        model: PieceModel,
        *,
        hidden_size: int,
        qkv_size: int,
        q_size: int,
        dtype: torch.dtype,
        max_num_tokens: int,
        device: torch.device,
        capture: bool,
        sizes: Sequence[int] | None = None,
        switch: Switch | None = None,
    ) -> None:
        self.model = model
        self.capture = capture
        self.switch = switch
        self.sizes = sorted(sizes) if sizes is not None else piece_capture_sizes(max_num_tokens)
        n, dev = self.sizes[-1], device
        self.max_num_tokens = n
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.qkv = torch.zeros((n, qkv_size), dtype=dtype, device=dev)
        self.attn_out = torch.zeros((n, q_size), dtype=dtype, device=dev)
        self.residual = torch.zeros((n, hidden_size), dtype=dtype, device=dev)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=dev)
        # (switch on, padded size) -> the graph of each piece
        self._graphs: dict[tuple[bool, int], list[torch.cuda.CUDAGraph]] = {}
        self.num_steps: dict[int, int] = {}  # padded size -> steps run at it
        self.replays = {False: 0, True: 0}  # switch position -> steps replayed from graphs

    def padded_size(self, num_tokens: int) -> int | None:
        for size in self.sizes:
            if size >= num_tokens:
                return size
        return None

    def _piece(self, i: int, t: int) -> None:
        """Piece ``i`` at ``t`` rows, from the static buffers into them."""
        if i == 0:
            x, residual = self.model.piece(0, self.input_ids[:t], None)
        else:
            x, residual = self.model.piece(i, self.attn_out[:t], self.residual[:t])
        if residual.data_ptr() != self.residual.data_ptr():  # not updated in place
            self.residual[:t].copy_(residual)
        out = self.hidden if i == self.model.num_pieces - 1 else self.qkv
        out[:t].copy_(x)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every piece at every size (and switch position), largest first, into one
        pool."""
        if not self.capture:
            return
        start = time.perf_counter()
        num_pieces = self.model.num_pieces

        def capture(pool: Any, stream: torch.cuda.Stream, on: bool) -> None:
            for t in reversed(self.sizes):
                for i in range(num_pieces):  # warm up: cuBLAS, Triton, the allocator
                    self._piece(i, t)
                graphs = []
                for i in range(num_pieces):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._piece(i, t)
                    graphs.append(graph)
                self._graphs[on, t] = graphs

        _on_side_stream(capture, self.switch)
        logger.info(
            "captured %d CUDA graphs for prompt steps (%d pieces x %d token counts, %d..%d) "
            "in %.1f s",
            len(self._graphs) * num_pieces,
            num_pieces,
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def release(self) -> None:
        """Destroy the captured graphs (steps then run the pieces eagerly)."""
        for graphs in self._graphs.values():
            for graph in graphs:
                graph.reset()
        self._graphs.clear()

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [n] on the device
        positions: torch.Tensor,  # [n]
        kv_caches: list[KVCacheView],
        metadata: AttentionMetadata,
        backend: AttentionBackend,
        switch_on: bool = False,
    ) -> torch.Tensor:
        """The final hidden states ``[n, hidden]`` of a step of ``n`` tokens (valid until the
        next step runs here), from the graphs captured with the switch at ``switch_on``."""
        n = input_ids.shape[0]
        t = self.padded_size(n)
        assert t is not None, f"a step of {n} tokens exceeds the largest captured size"
        self.num_steps[t] = self.num_steps.get(t, 0) + 1
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        rope = self.model.rope_for(positions)
        on = switch_on and self.switch is not None
        graphs = self._graphs.get((on, t))
        if graphs is not None:
            self.replays[on] += 1
        for i, kv_cache in enumerate(kv_caches):
            if graphs is None:
                self._piece(i, t)
            else:
                graphs[i].replay()
            out = self.model.attend(
                i, rope, self.qkv[:n], kv_cache, metadata, backend, self.residual[:n]
            )
            self.attn_out[:n].copy_(out)
        if graphs is None:
            self._piece(len(kv_caches), t)
        else:
            graphs[-1].replay()
        return self.hidden[:n]

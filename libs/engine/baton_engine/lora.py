"""LoRA adapters, served as vLLM serves them: many adapters over one base model, any mix of them
(and of the base model) in one batch.

An adapter is a PEFT folder: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` (or ``.bin``), with ``lora_A`` ``[r, in]`` and
``lora_B`` ``[out, r]`` for any of the decoder layers' seven projections. A request names its
adapter with a ``LoRARequest``; the engine keeps up to ``max_loras`` adapters on the device at
once (a step's requests use at most that many: the scheduler holds back the others) and loads
more from their folders as needed.

On the device each projection of the model is wrapped (``LoRALinear``): its output gains
``scale * B @ A @ x`` for every token whose request has an adapter, computed over all slots'
stacked columns with the other slots' masked out per token (``LoRABatch``): the same launches
whatever the mix, so CUDA graphs (decode steps, prompt-step pieces) hold them. On a GPU the
slots' ``A`` sit below the base weight (one GEMM gives the output and every slot's shrunk input)
and a Triton kernel adds each token's own slot's ``B`` product (``baton_kernels.triton.lora``);
elsewhere it is a shrink GEMM, a mask multiply and an expand GEMM. Steps without adapters skip
all of it. The fused projections (qkv, gate/up) stack their parts' ``A`` and place each part's
``B`` in its columns of the output. The engine's fused paths that skip the projections' own
modules (folded norms, GEMV layers, the CPU's one-call decode) are off while LoRA is enabled.

With tensor parallelism each rank holds its share of every adapter, split as the base weights
are: a column-parallel projection (q, k, v, gate, up) keeps all of ``A`` and its rows of ``B``; a
row-parallel one (o, down) its columns of ``A`` and all of ``B``, so that its partial delta
``B @ (A_rank @ x_rank)`` is summed across the ranks with the base output's partial products
(the same all-reduce; no collective of its own). The helper ranks hold the adapters rank 0 holds
(``held`` / ``mirror``), read from the same folders.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from baton_engine.config import ModelConfig
from baton_engine.errors import InvalidRequestError, ModelLoadError
from baton_engine.model_files import cached_snapshot, is_repo_id
from baton_engine.models.llama import ROW_PARALLEL, shard_config
from baton_engine.models.rotary import partial_rotation_order, reorder_heads

if TYPE_CHECKING:
    from baton_engine.runner.staging import InputStaging


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request, as vLLM's: its name (what prefix caching and the API's
    ``model`` field know it by), a positive id, and its folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise InvalidRequestError(f"lora_int_id must be at least 1, got {self.lora_int_id}")
        if not self.lora_path:
            raise InvalidRequestError(f"LoRA adapter {self.lora_name!r} needs a path")


class LoRALimits(NamedTuple):
    """What an engine with LoRA enabled holds: ``max_loras`` adapters on the device (those a
    step may use), of rank at most ``max_lora_rank``, and ``max_cpu_loras`` read on the host."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


def parse_lora_module(spec: str) -> tuple[str, str, str | None]:
    """One ``--lora-modules`` entry, as vLLM takes it: ``name=path`` or a JSON object with
    ``name``, ``path`` and optionally ``base_model_name``. Returns ``(name, path, base)``."""
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
        except ValueError as e:
            raise InvalidRequestError(f"--lora-modules {spec!r} is not valid JSON: {e}") from None
        name, path = obj.get("name") if isinstance(obj, dict) else None, None
        if isinstance(obj, dict):
            path = obj.get("path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise InvalidRequestError(
                f"--lora-modules {spec!r} needs a JSON object with a name and a path"
            )
        base = obj.get("base_model_name")
        return name, path, base if isinstance(base, str) else None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise InvalidRequestError(f"--lora-modules takes name=path (or JSON), got {spec!r}")
    return name, path, None


def lora_requests(specs: Sequence[str]) -> dict[str, LoRARequest]:
    """``--lora-modules`` entries as ``LoRARequest``s by name (ids 1, 2, ... in order)."""
    out: dict[str, LoRARequest] = {}
    for i, spec in enumerate(specs, 1):
        name, path, base = parse_lora_module(spec)
        if name in out:
            raise InvalidRequestError(f"--lora-modules names {name!r} twice")
        out[name] = LoRARequest(name, i, path, base)
    return out


# fused projection -> its parts, as the adapter names them, in the order of its output rows
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
TARGETS = tuple(part for parts in FUSED_PARTS.values() for part in parts)
_MLP_TARGETS = (*FUSED_PARTS["gate_up_proj"], *FUSED_PARTS["down_proj"], "gate_up_proj")
# fused projections a checkpoint may hold whole (Phi-3), and adapters target as one
_FUSED_TARGETS = ("qkv_proj", "gate_up_proj")
_WEIGHT = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def part_shape(cfg: ModelConfig, part: str) -> tuple[int, int]:
    """``(in, out)`` features of one projection of the model (an adapter's target)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[part]


@dataclass
class LoRAAdapter:
    """An adapter's weights on the host: ``(layer, part) -> (A [r, in], B [out, r])`` with
    ``B`` already multiplied by the adapter's scale."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_adapter(request: LoRARequest, cfg: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT adapter folder (or, as vLLM, a Hugging Face repository id in the
    local cache); ``InvalidRequestError`` says what is wrong."""
    name, folder = request.lora_name, Path(request.lora_path)

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"LoRA adapter {name!r} ({folder}): {why}")

    if is_repo_id(request.lora_path):
        try:
            folder = cached_snapshot(request.lora_path)
        except ModelLoadError as e:
            raise InvalidRequestError(f"LoRA adapter {name!r}: {e}") from None

    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise refuse("no adapter_config.json") from None
    except (OSError, ValueError) as e:
        raise refuse(f"cannot read adapter_config.json: {e}") from None
    if not isinstance(config, dict):
        raise refuse("adapter_config.json is not an object")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise refuse("adapter_config.json needs a positive integer r and a number lora_alpha")
    if rank > max_rank:
        raise refuse(f"its rank {rank} is above max_lora_rank {max_rank} (raise --max-lora-rank)")
    for key, what in (
        ("use_dora", "DoRA adapters are not supported"),
        ("fan_in_fan_out", "fan_in_fan_out weights are not supported"),
        ("modules_to_save", "modules_to_save (whole trained modules) are not supported"),
        ("rank_pattern", "per-module ranks (rank_pattern) are not supported"),
        ("alpha_pattern", "per-module alphas (alpha_pattern) are not supported"),
    ):
        if config.get(key):
            raise refuse(what)
    if config.get("bias", "none") != "none":
        raise refuse(f"bias {config['bias']!r} is not supported (only 'none')")
    scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    tensors = _read_tensors(folder, refuse)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _WEIGHT.search(key)
        if match is None:
            raise refuse(f"weight {key!r} is not a LoRA weight of a supported projection")
        layer, part, which = int(match[1]), match[2], match[3]
        if part not in TARGETS and part not in _FUSED_TARGETS:
            targets = ", ".join((*TARGETS, *_FUSED_TARGETS))
            raise refuse(f"target {part!r} is not supported (targets: {targets})")
        if not 0 <= layer < cfg.num_layers:
            raise refuse(f"weight {key!r} names layer {layer}; the model has {cfg.num_layers}")
        if part in _MLP_TARGETS and cfg.is_moe_layer(layer):
            raise refuse(
                f"weight {key!r}: layer {layer}'s MLP is a mixture of experts (adapters on "
                "experts are not supported)"
            )
        pairs.setdefault((layer, part), {})[which] = tensor
    if not pairs:
        raise refuse("it holds no LoRA weights")
    pairs = _split_fused_targets(pairs, cfg, refuse)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, part), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise refuse(f"layer {layer} {part} has lora_{next(iter(ab))} only")
        a, b = ab["A"], ab["B"]
        in_f, out_f = part_shape(cfg, part)
        if tuple(a.shape) != (rank, in_f) or tuple(b.shape) != (out_f, rank):
            raise refuse(
                f"layer {layer} {part}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                f"do not fit the model (expected {(rank, in_f)} and {(out_f, rank)})"
            )
        if part in ("o_proj", "down_proj"):  # (Granite scales what these add to the stream)
            b = b * cfg.residual_multiplier
        if part in ("q_proj", "k_proj") and cfg.rotary_dim:  # (as loading reorders the model's)
            b = reorder_heads(b, partial_rotation_order(cfg.head_dim, cfg.rotary_dim))
        weights[layer, part] = (a.float(), b.float() * scale)
    return LoRAAdapter(name, request.lora_path, rank, weights)  # (the path as named)


def _split_fused_targets(
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]],
    cfg: ModelConfig,
    refuse: Callable[[str], InvalidRequestError],
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """``pairs`` with each adapter of a fused projection (Phi-3's ``qkv_proj`` and
    ``gate_up_proj``) as adapters of its parts: the same ``A``, ``B``'s rows of each part."""
    out: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (layer, part), ab in pairs.items():
        if part not in _FUSED_TARGETS:
            out.setdefault((layer, part), {}).update(ab)
            continue
        parts = FUSED_PARTS[part]
        sizes = [part_shape(cfg, p)[1] for p in parts]
        b = ab.get("B")
        if b is not None and b.shape[0] != sum(sizes):
            raise refuse(
                f"layer {layer} {part}: lora_B has {b.shape[0]} rows; the projection has "
                f"{sum(sizes)}"
            )
        for i, sub in enumerate(parts):
            if (layer, sub) in pairs:
                raise refuse(f"layer {layer} has adapters for both {part} and {sub}")
            piece = dict(ab)
            if b is not None:
                piece["B"] = torch.split(b, sizes)[i]
            out[(layer, sub)] = piece
    return out


def _read_tensors(
    folder: Path, refuse: Callable[[str], InvalidRequestError]
) -> dict[str, torch.Tensor]:
    for file in ("adapter_model.safetensors", "adapter_model.bin"):
        path = folder / file
        if not path.exists():
            continue
        try:
            if file.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a corrupt file: any of safetensors' or torch's errors
            raise refuse(f"cannot read {file}: {e}") from None
        if isinstance(loaded, dict) and all(isinstance(t, torch.Tensor) for t in loaded.values()):
            return loaded
        raise refuse(f"{file} is not a dict of tensors")
    raise refuse("no adapter_model.safetensors or adapter_model.bin")


class LoRABatch:
    """Which device slot each token of the current step uses (``slots``, -1: none) and, for
    the projections without the expand kernel, the same as one mask per width of their
    adapter columns (``masks[width][t, c]`` is 1 where column ``c`` of a ``max_loras *
    width``-wide stack belongs to token ``t``'s slot), in buffers of ``max_num_tokens`` rows
    whose addresses never change: CUDA graphs read them as captured. ``active``: some token of
    the step has an adapter; steps without skip the adapters (CUDA graphs are captured both
    ways, the runner's graph switch) and leave the buffers as they were."""

    def __init__(
        self, max_loras: int, max_num_tokens: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.active = False
        self.max_loras = max_loras
        self.dtype = dtype
        self.slots = torch.full((max_num_tokens,), -1, dtype=torch.long, device=device)
        self.masks: dict[int, torch.Tensor] = {}
        self._hits: dict[int, torch.Tensor] = {}  # the masks as booleans, before the cast
        self._columns: dict[int, torch.Tensor] = {}  # width -> each stacked column's slot

    def need_masks(self, width: int) -> None:
        """Keep the masks of ``width`` columns a slot from now on."""
        if width in self.masks:
            return
        slots = self.slots
        self._columns[width] = torch.arange(self.max_loras * width, device=slots.device) // width
        shape = (slots.shape[0], self.max_loras * width)
        self.masks[width] = torch.zeros(shape, dtype=self.dtype, device=slots.device)
        self._hits[width] = torch.zeros(shape, dtype=torch.bool, device=slots.device)

    def set(self, slots: torch.Tensor) -> None:
        """The step's tokens' slots (-1: none), in order, on the device."""
        n = slots.shape[0]
        self.slots[:n].copy_(slots)
        for width, cols in self._columns.items():
            hits = self._hits[width][:n]
            torch.eq(self.slots[:n, None], cols[None, :], out=hits)
            self.masks[width][:n].copy_(hits)


class LoRALinear(nn.Module):
    """A projection of the model with ``max_loras`` adapter slots: ``base(x)`` plus, for each
    token, ``x @ A[slot].T @ B[slot].T`` of its slot (``B`` scaled), over every slot's stacked
    columns with the other slots' masked out (``LoRABatch``): the same launches whatever the
    mix of adapters, so that CUDA graphs can hold them. ``parts`` names the adapter targets
    fused into ``base``, in the order of its output rows; each part has ``max_rank`` columns a
    slot.

    With ``expand_kernel`` (``base`` an ``nn.Linear`` on a GPU) the slots' ``A`` are rows of
    one matrix below ``base``'s weight (which becomes a view of it): a step with adapters runs
    one GEMM for the output and every slot's shrunk input, then ``lora_expand``. Otherwise a
    shrink GEMM, the mask multiply and an expand GEMM follow ``base``."""

    def __init__(
        self,
        base: nn.Module,
        parts: Sequence[str],
        cfg: ModelConfig,
        max_loras: int,
        max_rank: int,
        batch: LoRABatch,
        dtype: torch.dtype,
        device: torch.device,
        expand_kernel: bool = False,
        tp_rank: int = 0,
    ) -> None:
        """``cfg``: the shape of this rank's shard (the whole model's on one rank);
        ``tp_rank``: which share of an adapter's weights this rank takes."""
        super().__init__()
        self.base = base
        self.tp_rank = tp_rank
        self.parts = tuple(parts)
        self.batch = batch
        self.max_rank = max_rank
        self.width = len(parts) * max_rank
        in_f = self.in_features = part_shape(cfg, parts[0])[0]
        self.out_offsets = [0]
        for part in parts:
            self.out_offsets.append(self.out_offsets[-1] + part_shape(cfg, part)[1])
        out_f = self.out_offsets[-1]
        stacked = max_loras * self.width
        # A of every slot stacked: [max_loras * width, in], below the base weight with the
        # kernel; B of every slot stacked, transposed: [max_loras * width, out]
        self.w_ext: torch.Tensor | None = None
        self.bias_ext: torch.Tensor | None = None
        if expand_kernel:
            assert isinstance(base, nn.Linear)
            self.w_ext = torch.zeros(out_f + stacked, in_f, dtype=dtype, device=device)
            self.w_ext[:out_f].copy_(base.weight.detach())
            base.weight = nn.Parameter(self.w_ext[:out_f], requires_grad=False)
            if base.bias is not None:
                self.bias_ext = torch.zeros(out_f + stacked, dtype=dtype, device=device)
                self.bias_ext[:out_f].copy_(base.bias.detach())
                base.bias = nn.Parameter(self.bias_ext[:out_f], requires_grad=False)
            self.a_all = self.w_ext[out_f:]
        else:
            self.a_all = torch.zeros(stacked, in_f, dtype=dtype, device=device)
            batch.need_masks(self.width)
        self.lora_a = self.a_all.view(max_loras, self.width, in_f)
        self.lora_b = torch.zeros(max_loras, self.width, out_f, dtype=dtype, device=device)
        self.b_t = self.lora_b.view(stacked, out_f)

    def set_slot(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        """Put ``adapter``'s weights of this projection (layer ``layer``) in ``slot``; parts
        the adapter does not target stay zero."""
        a, b = self.lora_a[slot], self.lora_b[slot]
        a.zero_()
        b.zero_()
        for j, part in enumerate(self.parts):
            pair = adapter.weights.get((layer, part))
            if pair is None:
                continue
            lora_a, lora_b = pair
            rows = self.out_offsets[j + 1] - self.out_offsets[j]
            if part in ROW_PARALLEL:  # this rank's input columns (all of them on one rank)
                lora_a = lora_a.narrow(1, self.tp_rank * self.in_features, self.in_features)
            else:  # this rank's output rows
                lora_b = lora_b.narrow(0, self.tp_rank * rows, rows)
            r, col = lora_a.shape[0], j * self.max_rank
            a[col : col + r].copy_(lora_a)
            b[col : col + r, self.out_offsets[j] : self.out_offsets[j + 1]].copy_(lora_b.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.batch.active:
            return self.base(x)  # type: ignore[no-any-return]
        slots = self.batch.slots[: x.shape[0]]
        if self.w_ext is not None:
            from baton_kernels.triton.lora import lora_expand

            return lora_expand(F.linear(x, self.w_ext, self.bias_ext), slots, self.b_t, self.width)
        y: torch.Tensor = self.base(x)
        h = x @ self.a_all.t()
        h *= self.batch.masks[self.width][: x.shape[0]]
        return y.addmm_(h, self.b_t)


class LoRAManager:
    """The runner's adapters: each projection wrapped in a ``LoRALinear``, ``max_loras`` device
    slots filled on demand (the least recently used slot outside the step is overwritten), and
    the adapters read so far on the host (``max_cpu_loras`` of them, but never one a live
    request names: ``in_use``)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_num_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
        expand_kernel: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        """``cfg``: the whole model's shape (adapters are checked against it); ``model``:
        rank ``tp_rank``'s shard of ``tp_size``. ``expand_kernel``: the projections that are
        ``nn.Linear`` compute the adapters' deltas with ``lora_expand`` (a GPU's Triton
        kernel; the others mask)."""
        self.cfg = cfg
        shard = shard_config(cfg, tp_size)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.batch = LoRABatch(max_loras, max_num_tokens, dtype, device)
        self.layers: list[tuple[int, LoRALinear]] = []
        for i, layer in enumerate(model.layers):  # type: ignore[arg-type]
            for owner in (layer.self_attn, layer.mlp):
                for fused, parts in FUSED_PARTS.items():
                    base = getattr(owner, fused, None)
                    if base is None:
                        continue
                    wrapped = LoRALinear(
                        base, parts, shard, max_loras, max_lora_rank, self.batch, dtype, device,
                        expand_kernel=expand_kernel and type(base) is nn.Linear, tp_rank=tp_rank,
                    )  # fmt: skip
                    setattr(owner, fused, wrapped)
                    self.layers.append((i, wrapped))
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recent first
        self.slots: list[str | None] = [None] * max_loras
        self._slot_use = [0] * max_loras  # the step that last used each slot
        self._steps = 0
        self.version = 0  # changes whenever the adapters held do (helper ranks follow them)

    def add(self, request: LoRARequest, in_use: Mapping[str, int] | None = None) -> LoRAAdapter:
        """Read ``request``'s adapter unless already held (``InvalidRequestError`` if it cannot
        be used); adapters beyond ``max_cpu_loras`` that no live request names are dropped."""
        known = self.adapters.get(request.lora_name)
        if known is not None:
            if Path(known.path) != Path(request.lora_path):
                raise InvalidRequestError(
                    f"LoRA adapter {request.lora_name!r} is loaded from {known.path}, not "
                    f"{request.lora_path}"
                )
            self.adapters.move_to_end(request.lora_name)
            return known
        adapter = load_adapter(request, self.cfg, self.max_lora_rank)
        self.adapters[request.lora_name] = adapter
        self.version += 1
        for name in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                break
            if name != request.lora_name and not (in_use or {}).get(name):
                self.remove(name)
        return adapter

    def remove(self, name: str) -> bool:
        """Forget an adapter (vLLM's unload); False if it was not held."""
        if self.adapters.pop(name, None) is None:
            return False
        self.version += 1
        self._drop_slot(name)
        return True

    def held(self) -> list[tuple[str, str]]:
        """``(name, folder)`` of each adapter held, least recently used first."""
        return [(adapter.name, adapter.path) for adapter in list(self.adapters.values())]

    def mirror(self, held: Sequence[tuple[str, str]]) -> None:
        """Hold exactly the adapters of ``held`` (rank 0's ``held()``, on a helper rank):
        drop the others, read the missing ones."""
        want = dict(held)
        for name, adapter in list(self.adapters.items()):
            if want.get(name) != adapter.path:
                self.remove(name)
        for name, path in held:  # (as rank 0 does, it may hold more than max_cpu_loras)
            self.add(LoRARequest(name, 1, path), in_use=dict.fromkeys(want, 1))

    def _drop_slot(self, name: str) -> None:
        if name in self.slots:
            self.slots[self.slots.index(name)] = None

    def set_batch(
        self, names: Sequence[str | None], counts: np.ndarray, staging: InputStaging
    ) -> None:
        """Set the step's tokens' adapters: request ``i`` (adapter ``names[i]``, None for the
        base model; no names: none has one) has ``counts[i]`` tokens, in order."""
        self._steps += 1
        needed = list(dict.fromkeys(n for n in names if n is not None))
        if len(needed) > self.max_loras:
            raise RuntimeError(
                f"a step uses {len(needed)} LoRA adapters; max_loras is {self.max_loras}"
            )
        slot_of = {name: self._slot(name, needed) for name in needed}
        per_req = np.fromiter(
            (-1 if n is None else slot_of[n] for n in names), dtype=np.int64, count=len(names)
        )
        self.batch.active = bool(needed)
        if needed:
            self.batch.set(staging.to_device(np.repeat(per_req, counts), torch.long))

    def _slot(self, name: str, needed: list[str]) -> int:
        """The slot holding adapter ``name``, filled now if none does: a free one, else the
        least recently used one whose adapter this step does not need."""
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            free = [i for i, held in enumerate(self.slots) if held is None]
            if free:
                slot = free[0]
            else:
                slot = min(
                    (i for i, held in enumerate(self.slots) if held not in needed),
                    key=lambda i: self._slot_use[i],
                )
            adapter = self.adapters[name]
            for layer, wrapped in self.layers:
                wrapped.set_slot(slot, layer, adapter)
            self.slots[slot] = name
        self._slot_use[slot] = self._steps
        return slot

"""compressed-tensors' integer checkpoints (llm-compressor's W4A16, W8A16 and W8A8: weights of 4
or 8 bits, packed into int32s or int8, a scale a group of columns, an output channel or the
tensor, with or without zero points) load with their weights dequantized and generate what
transformers generates from them. The checkpoints are a tiny model quantized and saved here by
compressed-tensors itself; the references decompress them with compressed-tensors (and, where
transformers reads the checkpoint, with transformers' own loading)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():  # (the packed layers' Triton kernels: under the interpreter)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from compressed_tensors.compressors import BaseCompressor, ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams
from lora_adapters import merged_greedy, write_adapter
from safetensors.torch import load_file, save_file
from tiny_models import build_model, hf_greedy

from baton import LLM, LoRARequest, SamplingParams
from baton_engine.errors import ModelLoadError
from baton_engine.model_loader import dequantized_int
from baton_kernels.int_linear import IntLinear

PROMPTS = [[10 + i for i in range(n)] for n in (5, 23)]
# name: (the weights' QuantizationArgs, activations' or None, the checkpoint's format)
SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str]] = {
    "w4a16-group": (
        {"num_bits": 4, "strategy": "group", "group_size": 16, "symmetric": True}, None,
        "pack-quantized",
    ),
    "w4a16-group-asymmetric": (
        {"num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": False}, None,
        "pack-quantized",
    ),
    "w8a16-channel": (
        {"num_bits": 8, "strategy": "channel", "symmetric": True}, None, "pack-quantized",
    ),
    "w4a16-channel-asymmetric": (
        {"num_bits": 4, "strategy": "channel", "symmetric": False}, None, "pack-quantized",
    ),
    "w8a8-channel": (
        {"num_bits": 8, "strategy": "channel", "symmetric": True},
        {"num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True},
        "int-quantized",
    ),
}  # fmt: skip


def _scheme(name: str) -> QuantizationScheme:
    weights, activations, _ = SCHEMES[name]
    return QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(type="int", **weights),
        input_activations=QuantizationArgs(type="int", **activations) if activations else None,
    )


def _quantized_folder(name: str, default_model_dir: Path, out: Path, **overrides: Any) -> None:
    """A tiny Llama (its config changed by ``overrides``) quantized by compressed-tensors
    (scales and zero points from each group's range: a minmax observer's) and saved compressed
    in ``out``."""
    model = build_model("llama", default_model_dir, out, **overrides)
    scheme, fmt = _scheme(name), SCHEMES[name][2]
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=fmt)
    apply_quantization_config(model, config)
    args = scheme.weights
    assert args is not None
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data
        size = args.group_size if args.strategy == "group" else w.shape[1]
        grouped = w.reshape(w.shape[0], -1, size)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    assert compressor is not None
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))


def _decompressed(
    tensors: dict[str, torch.Tensor], scheme: QuantizationScheme, fmt: str, model: Any
) -> dict[str, torch.Tensor]:
    """The weights compressed-tensors' own compressor of ``fmt`` decompresses from
    ``tensors`` (a checkpoint's, float32 scales), loaded into ``model`` (transformers')."""
    compressor: Any = BaseCompressor.get_value_from_registry(fmt)
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for n, t in tensors.items():
        key, _, part = n.rpartition(".")
        if part.startswith(("weight_", "input_")) or (
            part == "weight" and not t.is_floating_point()
        ):
            layers.setdefault(key, {})[part] = t.float() if part == "weight_scale" else t
    weights = {
        f"{key}.weight": compressor.decompress(parts, scheme)["weight"].float()
        for key, parts in layers.items()
    }
    model.load_state_dict(weights, strict=False)
    return weights


def _engine(folder: Path, packed: bool = False, **kwargs: Any) -> LLM:
    """An engine of ``folder``; ``packed``: with the integer weights kept packed
    (``IntLinear``, checked) rather than dequantized on load."""
    os.environ["BATON_PACKED_INT_WEIGHTS"] = "1" if packed else "0"
    try:
        llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
                  **kwargs)  # fmt: skip
    finally:
        del os.environ["BATON_PACKED_INT_WEIGHTS"]
    model = llm.engine.core.runner.model
    layers = [m for m in model.modules() if isinstance(m, IntLinear)]
    assert len(layers) == (2 * 4 if packed else 0) and model.int_linears == packed
    return llm


def _tokens(llm: LLM, **kwargs: Any) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    got = llm.generate(prompts, params, use_tqdm=False, **kwargs)  # type: ignore[arg-type]
    return [list(g.outputs[0].token_ids) for g in got]


def _greedy(folder: Path, packed: bool = False, **kwargs: Any) -> list[list[int]]:
    """The engine's greedy tokens of ``PROMPTS`` (``_engine``'s arguments)."""
    llm = _engine(folder, packed, **kwargs)
    try:
        return _tokens(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_an_integer_checkpoint_generates_its_decompressed_model(
    name: str, default_model_dir: Path, tmp_path: Path
) -> None:
    _quantized_folder(name, default_model_dir, tmp_path / "quantized")
    reference = build_model("llama", default_model_dir, tmp_path / "float")  # (the same seed)
    unquantized = {n: p.clone() for n, p in reference.state_dict().items()}
    tensors = load_file(str(tmp_path / "quantized" / "model.safetensors"))
    weights = _decompressed(tensors, _scheme(name), SCHEMES[name][2], reference)
    assert len(weights) == 2 * 7  # (two layers' seven projections; the LM head kept as is)
    assert all(not torch.equal(w, unquantized[n]) for n, w in weights.items())
    want = hf_greedy(reference, PROMPTS, 10)
    assert want != hf_greedy(build_model("llama", default_model_dir, tmp_path / "f"), PROMPTS, 10)
    assert _greedy(tmp_path / "quantized") == want
    assert _greedy(tmp_path / "quantized", quantization="compressed-tensors") == want
    assert _greedy(tmp_path / "quantized", packed=True) == want


def test_packed_layers_split_across_two_ranks(default_model_dir: Path, tmp_path: Path) -> None:
    """Tensor parallelism over packed layers: o_proj's and down_proj's words, scales and zero
    points split by columns (a rank's 128 and 256 columns: whole spans of 4-bit words, groups
    of 32), the others by rows."""
    wider = {"hidden_size": 256, "intermediate_size": 512}
    _quantized_folder("w4a16-group-asymmetric", default_model_dir, tmp_path / "quantized", **wider)
    want = _greedy(tmp_path / "quantized")
    assert _greedy(tmp_path / "quantized", packed=True, tensor_parallel_size=2) == want


def test_adapters_and_sleep_over_packed_layers(default_model_dir: Path, tmp_path: Path) -> None:
    """A LoRA adapter over packed layers generates what transformers does with the adapter
    merged into the decompressed weights; the packed weights sleep (level 1, and without
    adapters level 2) and wake to the same tokens."""
    name = "w4a16-group-asymmetric"
    _quantized_folder(name, default_model_dir, tmp_path / "quantized")
    reference = build_model("llama", default_model_dir, tmp_path / "float")
    tensors = load_file(str(tmp_path / "quantized" / "model.safetensors"))
    _decompressed(tensors, _scheme(name), SCHEMES[name][2], reference)
    shapes = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
              "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64)}  # fmt: skip
    adapter = write_adapter(tmp_path / "adapter", rank=4, alpha=8, targets=tuple(shapes),
                            seed=3, shapes=shapes, num_layers=2, scale=0.3)  # fmt: skip
    want = merged_greedy(reference, adapter, PROMPTS, 10)
    assert want != hf_greedy(reference, PROMPTS, 10)
    llm = _engine(tmp_path / "quantized", packed=True, enable_lora=True, max_lora_rank=4,
                  enable_sleep_mode=True)  # fmt: skip
    try:
        assert _tokens(llm, lora_request=LoRARequest("a", 1, str(adapter))) == want
        plain = _tokens(llm)
        assert plain == hf_greedy(reference, PROMPTS, 10)
        llm.sleep(level=1)
        llm.wake_up()
        assert _tokens(llm) == plain
    finally:
        llm.shutdown()
    llm = _engine(tmp_path / "quantized", packed=True, enable_sleep_mode=True)
    try:  # (level 2 drops the weights: read again from the checkpoint, packed)
        llm.sleep(level=2)
        llm.wake_up()
        assert _tokens(llm) == plain
    finally:
        llm.shutdown()


def test_transformers_reads_the_same_w4a16_checkpoint(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """transformers' own loading of the checkpoint (its compressed-tensors integration)."""
    import transformers

    _quantized_folder("w4a16-group", default_model_dir, tmp_path / "quantized")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "quantized"), dtype=torch.float32
    ).eval()
    assert _greedy(tmp_path / "quantized") == hf_greedy(model, PROMPTS, 10)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # (AutoAWQ's: value j of a word is column AWQ_ORDER[j])
AWQ_GROUP = 32


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """``[R, N]`` 4-bit values as AutoAWQ packs them, ``[R, N / 8]`` int32 words."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for j, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8].to(torch.int32) << (4 * j)
    return words


def _awq_folder(default_model_dir: Path, out: Path, zero_point: bool) -> dict[str, torch.Tensor]:
    """A tiny Llama quantized here into AutoAWQ's GEMM layout (4 bits, a scale and a zero point
    a group of 32 input rows and an output column; without zero points: values offset by 8);
    returns the checkpoint's tensors."""
    build_model("llama", default_model_dir, out)
    tensors: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(out / "model.safetensors")).items():
        if "_proj.weight" not in name:
            tensors[name] = w
            continue
        key, wt = name.removesuffix(".weight"), w.float().t()  # (AWQ's [K, N])
        grouped = wt.reshape(-1, AWQ_GROUP, wt.shape[1])
        if zero_point:
            lo, hi = grouped.amin(1), grouped.amax(1)
            scale = ((hi - lo) / 15).clamp(min=1e-6).half().float()
            zero = (-lo / scale).round().clamp(0, 15)
        else:
            scale = (grouped.abs().amax(1) / 7).clamp(min=1e-6).half().float()
            zero = torch.full_like(scale, 8.0)
        q = (grouped / scale[:, None] + zero[:, None]).round().clamp(0, 15).reshape(wt.shape)
        tensors[f"{key}.qweight"] = _awq_pack(q.int())
        tensors[f"{key}.scales"] = scale.half()
        if zero_point:
            tensors[f"{key}.qzeros"] = _awq_pack(zero.int())
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "awq", "bits": 4, "group_size": AWQ_GROUP, "zero_point": zero_point,
        "version": "gemm", "modules_to_not_convert": None,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("zero_point", [True, False])
def test_an_awq_checkpoint_generates_what_compressed_tensors_converts_it_to(
    zero_point: bool, default_model_dir: Path, tmp_path: Path
) -> None:
    """compressed-tensors' AutoAWQ converter reads the layout (an implementation of its own)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    tensors = _awq_folder(default_model_dir, tmp_path / "awq", zero_point)
    converted = AutoAWQConverter(group_size=AWQ_GROUP, zero_point=zero_point).process(dict(tensors))
    args = {"num_bits": 4, "strategy": "group", "group_size": AWQ_GROUP}
    scheme = QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(type="int", symmetric=not zero_point, **args)
    )
    reference = build_model("llama", default_model_dir, tmp_path / "float")
    unquantized = hf_greedy(reference, PROMPTS, 10)
    assert len(_decompressed(converted, scheme, "pack-quantized", reference)) == 2 * 7
    want = hf_greedy(reference, PROMPTS, 10)
    assert want != unquantized
    assert _greedy(tmp_path / "awq") == want
    assert _greedy(tmp_path / "awq", quantization="awq_marlin") == want
    assert _greedy(tmp_path / "awq", packed=True, quantization="awq") == want
    del tensors["model.layers.1.self_attn.v_proj.scales"]
    save_file(tensors, str(tmp_path / "awq" / "model.safetensors"))
    with pytest.raises(
        ModelLoadError, match=r"AWQ checkpoint: .*layers\.1\.self_attn\.v_proj has no scales"
    ):
        _greedy(tmp_path / "awq")


def test_group_indices_pick_each_columns_scale_and_zero_point() -> None:
    """An older llm-compressor's activation order: ``weight_g_idx`` names each column's group."""
    torch.manual_seed(0)
    rows, cols, groups = 8, 64, 4
    q = torch.randint(-8, 8, (rows, cols), dtype=torch.int32)
    zero = torch.randint(-3, 3, (rows, groups), dtype=torch.int32)
    scale = torch.rand(rows, groups) + 0.1
    g_idx = (torch.arange(cols) // (cols // groups))[torch.randperm(cols)].to(torch.int32)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int32)
    for k in range(cols):  # (the value + 8 in bits 4 * (k % 8) of word k // 8)
        packed[:, k // 8] |= (q[:, k] + 8) << (4 * (k % 8))
    parts = {
        "x.weight_packed": packed,
        "x.weight_shape": torch.tensor([rows, cols]),
        "x.weight_scale": scale.to(torch.bfloat16),
        "x.weight_zero_point": zero.to(torch.int8),
        "x.weight_g_idx": g_idx,
        "x.input_scale": torch.tensor(1.0),
        "y.weight": torch.ones(2, 2),
    }
    out = dict(dequantized_int(iter(parts.items())))
    assert sorted(out) == ["x.weight", "y.weight"]
    want = torch.empty(rows, cols)
    for k in range(cols):
        g = int(g_idx[k])
        want[:, k] = (q[:, k] - zero[:, g]).float() * scale[:, g].to(torch.bfloat16).float()
    torch.testing.assert_close(out["x.weight"], want, rtol=0, atol=0)


def test_bad_integer_checkpoints_are_refused(default_model_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "quantized"
    _quantized_folder("w4a16-group", default_model_dir, folder)
    weights_path, config_path = folder / "model.safetensors", folder / "config.json"
    tensors = load_file(str(weights_path))
    config = json.loads(config_path.read_text())
    quant = config["quantization_config"]

    def refused(match: str) -> None:
        with pytest.raises(ModelLoadError, match=match):
            LLM(str(folder), dtype="float32", kv_cache_memory=16 << 20)

    group = quant["config_groups"]["group_0"]
    three_bits = quant | {"config_groups": {"g": group | {"weights": group["weights"] | {
        "num_bits": 3}}}}  # fmt: skip
    config_path.write_text(json.dumps(config | {"quantization_config": three_bits}))
    refused(r"\('int', 3\)\"\] are not supported \(float 8-bit: FP8, or integers of 4 or 8")
    gemv = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    config_path.write_text(json.dumps(config | {"quantization_config": gemv}))
    refused(r"AWQ checkpoints of 4 bits, version 'gemv', are not supported \(4-bit, GEMM\)")
    sparse = quant | {"sparsity_config": {"format": "sparse-24-bitmask"}}
    config_path.write_text(json.dumps(config | {"quantization_config": sparse}))
    refused("sparsity 'sparse-24-bitmask' is not supported")
    config_path.write_text(json.dumps(config))
    for missing, why in (
        ("weight_scale", "has no weight_scale"),
        ("weight_shape", "has a weight_packed but no weight_shape"),
    ):
        dropped = f"model.layers.1.mlp.up_proj.{missing}"
        save_file({n: t for n, t in tensors.items() if n != dropped}, str(weights_path))
        refused(rf"layers\.1\.mlp\.up_proj {why}")
    cut = dict(tensors)
    cut["model.layers.0.self_attn.o_proj.weight_packed"] = cut[
        "model.layers.0.self_attn.o_proj.weight_packed"
    ][:, :3].contiguous()
    save_file(cut, str(weights_path))
    refused(r"o_proj has a weight_packed of \(64, 3\) torch.int32, not 4- or 8-bit")

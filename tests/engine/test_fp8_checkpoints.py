"""FP8 checkpoints (transformers' "fp8" by blocks, compressed-tensors' by output channel,
ModelOpt's by tensor) load with their weights dequantized, and generate what transformers does
with those dequantized weights; their KV cache scales serve an 8-bit KV cache; other
quantization methods, and an FP8 weight without its scale, are clear errors. The checkpoints
are a tiny model's weights quantized here."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import build_model, hf_greedy

from baton import LLM, SamplingParams
from baton_engine.errors import ModelLoadError

FP8_MAX = 448.0  # float8_e4m3fn's largest value
LINEAR = re.compile(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$")
BLOCK = (32, 16)
CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(BLOCK)},
    "compressed-tensors": {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
        "ignore": ["lm_head"],
    },
    "modelopt": {"quant_method": "modelopt", "quant_algo": "FP8"},
}  # fmt: skip


def _quantize(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as FP8 and its scale (by blocks, output channels or the whole tensor)."""
    rows, cols = w.shape
    if method == "fp8":
        br, bc = BLOCK
        blocks = w.abs().reshape(rows // br, br, cols // bc, bc).amax(dim=(1, 3))
        scale = blocks.clamp(min=1e-8) / FP8_MAX
        full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)
    elif method == "compressed-tensors":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / FP8_MAX
        full = scale
    else:
        scale = w.abs().amax().clamp(min=1e-8) / FP8_MAX
        full = scale
    return (w / full).to(torch.float8_e4m3fn), scale.float()


def _fp8_folder(
    method: str, model: torch.nn.Module, src: Path, out: Path
) -> dict[str, torch.Tensor]:
    """``src`` (a saved tiny model) as an FP8 checkpoint in ``out``; returns the dequantized
    weights, which are also loaded into ``model`` (transformers' reference)."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": CONFIGS[method]}))
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not LINEAR.search(name):
            tensors[name] = t
            continue
        w8, scale = _quantize(t.float(), method)
        key = name.removesuffix(".weight")
        tensors[name], tensors[f"{key}.{scale_name}"] = w8, scale
        if method == "modelopt":
            tensors[f"{key}.input_scale"] = torch.tensor(0.05)  # (static: unused here)
        full = scale
        if method == "fp8":
            full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
        dequantized[name] = w8.float() * full
    save_file(tensors, str(out / "model.safetensors"))
    model.load_state_dict(dequantized, strict=False)
    return dequantized


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_an_fp8_checkpoint_generates_its_dequantized_model(
    method: str, default_model_dir: Path, tmp_path: Path
) -> None:
    model = build_model("llama", default_model_dir, tmp_path / "model")
    dequantized = _fp8_folder(method, model, tmp_path / "model", tmp_path / "fp8")
    assert len(dequantized) == 2 * 7  # (two layers' seven projections)
    prompts = [[10 + i for i in range(n)] for n in (5, 23)]
    want = hf_greedy(model, prompts, 10)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(g.outputs[0].token_ids) for g in got] == want
    finally:
        llm.shutdown()


def test_other_quantizations_and_a_missing_scale_are_refused(
    default_model_dir: Path, tmp_path: Path
) -> None:
    model = build_model("llama", default_model_dir, tmp_path / "model")
    _fp8_folder("fp8", model, tmp_path / "model", tmp_path / "fp8")
    config_path = tmp_path / "fp8" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ModelLoadError, match="quantization method 'gptq' is not supported"):
        LLM(str(tmp_path / "fp8"), dtype="float32", kv_cache_memory=16 << 20)
    fp4 = CONFIGS["compressed-tensors"] | {"config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "float", "strategy": "group"}}}}  # fmt: skip
    config_path.write_text(json.dumps(config | {"quantization_config": fp4}))
    with pytest.raises(ModelLoadError, match=r"not supported \(float 8-bit: FP8, or integers"):
        LLM(str(tmp_path / "fp8"), dtype="float32", kv_cache_memory=16 << 20)
    config_path.write_text(json.dumps(config))
    weights_path = tmp_path / "fp8" / "model.safetensors"
    tensors = load_file(str(weights_path))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(weights_path))
    with pytest.raises(
        ModelLoadError, match=r"layers\.1\.mlp\.down_proj has a weight but no scale"
    ):
        LLM(str(tmp_path / "fp8"), dtype="float32", kv_cache_memory=16 << 20)


def test_a_weight_and_its_scale_pair_in_either_order() -> None:
    from baton_engine.model_loader import dequantized_fp8

    w8 = torch.tensor([[1.0, -2.0], [4.0, 0.5]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([[0.5], [2.0]])  # (one an output channel)
    want = torch.tensor([[0.5, -1.0], [8.0, 1.0]])
    norm = ("n.weight", torch.ones(2))
    for items in ([("p.weight", w8), ("p.weight_scale", scale), norm],
                  [("p.weight_scale", scale), norm, ("p.input_scale", torch.tensor(1.0)),
                   ("p.weight", w8)]):  # fmt: skip
        got = dict(dequantized_fp8(iter(items), None))
        assert set(got) == {"p.weight", "n.weight"}
        torch.testing.assert_close(got["p.weight"], want)
    # blocks of 2 x 2 over a weight of 3 x 5: the last row and column of blocks partial
    wide = torch.arange(1.0, 16.0).view(3, 5).to(torch.float8_e4m3fn)
    blocks = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    (got,) = dequantized_fp8(iter([("q.weight", wide), ("q.weight_scale_inv", blocks)]), (2, 2))
    per_element = blocks.repeat_interleave(2, 0)[:3].repeat_interleave(2, 1)[:, :5]
    torch.testing.assert_close(got[1], wide.float() * per_element)
    assert got[1][2, 4] == 15.0 * 8.0
    with pytest.raises(ValueError, match="scale of shape \\(3, 1\\) does not fit"):
        list(dequantized_fp8(iter([("p.weight", w8), ("p.weight_scale", torch.ones(3, 1))]), None))


KV_SCALE_NAMES = {  # how checkpoints name a layer's KV cache scales (vLLM reads each)
    "compressed-tensors": ("self_attn.k_scale", "self_attn.v_scale"),
    "modelopt": ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale"),
    "output_scale": ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
    "kv_scale": ("self_attn.kv_scale",),  # (deprecated: one for both)
}


def _greedy_run(
    folder: Path, **engine: Any
) -> tuple[list[list[int]], list[tuple[float, float]], torch.Tensor]:
    """Two prompts' greedy tokens on ``folder``'s model (an 8-bit KV cache unless ``engine``
    says otherwise), each layer's KV cache scales and a copy of the cache."""
    prompts = [[10 + i for i in range(n)] for n in (5, 23)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    settings = {"kv_cache_dtype": "fp8", **engine}
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20,
              **settings)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        scales = [(c.k_scale, c.v_scale) for c in llm.engine.core.runner.kv_caches]
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, scales, llm.engine.core.kv_pool.clone()
    finally:
        llm.shutdown()


def _kv_scaled(src: Path, out: Path, factor: float) -> None:
    """The saved model ``src`` in ``out`` with its K and V ``factor`` times larger: k_proj and
    v_proj scaled up, q_proj and o_proj down (the same model, exactly, for a power of two)."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    factors = {"k_proj": factor, "v_proj": factor, "q_proj": 1 / factor, "o_proj": 1 / factor}
    tensors = load_file(str(src / "model.safetensors"))
    for name in tensors:
        proj = name.split(".")[-2]
        if name.endswith(".weight") and proj in factors:
            tensors[name] = tensors[name] * factors[proj]
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize("names", sorted(KV_SCALE_NAMES))
def test_an_fp8_checkpoints_kv_cache_scales_serve_an_8bit_cache(
    names: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint whose K and V are 1024 times the model's (k_proj and v_proj scaled up,
    q_proj and o_proj down: the same model, exactly, powers of two) beyond e4m3's 448, with
    KV cache scales of 1024 in each layer: an FP8 cache divides K and V by them, so it holds
    the bytes the unscaled model's cache holds at unit scale, and the tokens are the same."""
    model = build_model("llama", default_model_dir, tmp_path / "model")
    _fp8_folder("modelopt", model, tmp_path / "model", tmp_path / "plain")
    _kv_scaled(tmp_path / "model", tmp_path / "scaled-src", 1024.0)
    _fp8_folder("modelopt", model, tmp_path / "scaled-src", tmp_path / "scaled")
    weights = tmp_path / "scaled" / "model.safetensors"
    tensors = load_file(str(weights))
    for layer in range(2):
        for name in KV_SCALE_NAMES[names]:
            tensors[f"model.layers.{layer}.{name}"] = torch.tensor(1024.0)
    save_file(tensors, str(weights))

    plain, plain_scales, plain_pool = _greedy_run(tmp_path / "plain")
    scaled, scaled_scales, scaled_pool = _greedy_run(tmp_path / "scaled")
    assert plain_scales == [(1.0, 1.0)] * 2 and scaled_scales == [(1024.0, 1024.0)] * 2
    assert torch.equal(scaled_pool.view(torch.uint8), plain_pool.view(torch.uint8))
    assert scaled == plain


def test_calculated_kv_scales_follow_the_models_k_and_v(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's --calculate-kv-scales: the same model with its K and V 1024 times larger (beyond
    e4m3's 448) gets scales 1024 times larger from the start-up pass, so its 8-bit cache holds
    the bytes the model's own holds and it generates the same tokens; with unit scales its K
    and V saturate. A 16-bit cache is left as it is."""
    build_model("llama", default_model_dir, tmp_path / "model")
    _kv_scaled(tmp_path / "model", tmp_path / "scaled", 1024.0)
    runs = {
        (folder, calculate, kv): _greedy_run(
            tmp_path / folder, kv_cache_dtype=kv, calculate_kv_scales=calculate
        )
        for folder, calculate, kv in [("model", True, "fp8"), ("scaled", True, "fp8"),
                                      ("scaled", False, "fp8"), ("model", True, "auto")]
    }  # fmt: skip
    plain, plain_scales, plain_pool = runs["model", True, "fp8"]
    scaled, scaled_scales, scaled_pool = runs["scaled", True, "fp8"]
    assert all(k not in (0.0, 1.0) and v not in (0.0, 1.0) for k, v in plain_scales)
    assert scaled_scales == [(1024.0 * k, 1024.0 * v) for k, v in plain_scales]
    assert torch.equal(scaled_pool.view(torch.uint8), plain_pool.view(torch.uint8))
    assert scaled == plain
    unit_pool = runs["scaled", False, "fp8"][2]
    assert unit_pool.float().abs().max().item() == FP8_MAX
    assert runs["model", True, "auto"][1] == [(1.0, 1.0)] * 2

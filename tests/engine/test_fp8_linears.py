"""FP8 linear layers (W8A8: ``--quantization fp8``): the projections' weights are FP8 with a
scale an output row and activations are quantized per token. A bfloat16/float32 checkpoint is
quantized on load; an FP8 checkpoint's weights are served as they are (its scales a tensor or
an output channel), computing what transformers computes with each projection's product made
W8A8 by hand. The GPU's FP8 GEMMs: ``tests/gpu/test_engine_gpu.py``."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from test_fp8_checkpoints import _fp8_folder
from tiny_models import build_model, forced_logprobs, greedy_tokens, hf_greedy

from baton import LLM, SamplingParams
from baton_engine.errors import InvalidRequestError
from baton_kernels.fp8_linear import Fp8Linear

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NUM_TOKENS = 12
SMALL: dict[str, Any] = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 16 << 20}


def fp8_layers(llm: LLM) -> list[Fp8Linear]:
    model = llm.engine.core.runner.model
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def run(model_dir: Path, forced: list[list[int]] | None = None, **settings: Any) -> Any:
    """An engine's greedy tokens for ``PROMPTS``, the logprobs it gives each token of ``forced``
    (prompts with a continuation: its own by default), and its FP8 layers' weight bytes."""
    llm = LLM(str(model_dir), **SMALL, **settings)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        tokenizer = llm.get_tokenizer()
        if forced is None:
            forced = [tokenizer(p).input_ids + t for p, t in zip(PROMPTS, tokens, strict=True)]
        logprobs = forced_logprobs(llm, forced)
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in fp8_layers(llm))
        return tokens, forced, logprobs, len(fp8_layers(llm)), weight_bytes
    finally:
        llm.shutdown()


def test_quantization_fp8_quantizes_the_projections_and_generates_close_to_the_model(
    default_model_dir: Path,
) -> None:
    """SmolLM2's 30 layers' 4 projections become FP8 (a quarter of their float32 bytes); the
    model's own continuations, scored by the FP8 engine (teacher-forced), differ by less than
    0.25 nats a token on average, and its first greedy tokens are the model's. (Measured:
    0.15; with the weights' rounding alone, the activations unquantized, 0.095: a 135M model
    of hidden size 576 is sensitive to FP8, whose 3 mantissa bits err by up to 6%.)"""
    want_tokens, forced, want_logprobs, none, _ = run(default_model_dir)
    assert none == 0
    tokens, _, logprobs, num_layers, weight_bytes = run(
        default_model_dir, forced, quantization="fp8"
    )
    assert num_layers == 30 * 4
    hidden, inter, q, kv = 576, 1536, 576, 2 * 192
    assert weight_bytes == 30 * (hidden * (q + kv) + q * hidden + 3 * hidden * inter)
    gaps = [abs(a - b) for got, want in zip(logprobs, want_logprobs, strict=True)
            for a, b in zip(got, want, strict=True)]  # fmt: skip
    assert sum(gaps) / len(gaps) < 0.25, gaps
    assert [t[:2] for t in tokens] == [t[:2] for t in want_tokens]


def _w8a8(module: torch.nn.Linear, w8: torch.Tensor, scale: torch.Tensor, slices: int = 1) -> None:
    """Make ``module`` (transformers') compute W8A8 with the checkpoint's FP8 weight ``w8`` and
    ``scale`` (one, or one a row): each row of the input times ``448 / max|row|``, rounded to
    FP8, both products' scales applied to the float32 product. ``slices``: the input's columns
    in that many slices, each quantized and multiplied on its own, the products summed (a
    row-parallel projection split across ranks)."""
    w = w8.float() * scale.float().reshape(-1, 1)

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(*x.shape[:-1], w.shape[0])
        for xs, ws in zip(x.chunk(slices, -1), w.chunk(slices, -1), strict=True):
            s = xs.abs().amax(dim=-1, keepdim=True).float() * (1.0 / 448.0)
            s = s.clamp(min=1.0 / (448.0 * 512))
            q = (xs.float() * (1.0 / s)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            out += (q.float() * s) @ ws.t()
        return (out if self.bias is None else out + self.bias).to(x.dtype)

    module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]


def _fp8_reference(
    default_model_dir: Path, tmp_path: Path, method: str, slices: int = 1
) -> tuple[dict[str, torch.Tensor], list[list[int]], list[list[int]]]:
    """An FP8 checkpoint of the tiny Llama in ``tmp_path / "fp8"``, its tensors, two prompts,
    and transformers' greedy tokens for them with each projection W8A8 from the checkpoint's
    weights (o_proj and down_proj in ``slices``)."""
    model = build_model("llama", default_model_dir, tmp_path / "model")
    _fp8_folder(method, model, tmp_path / "model", tmp_path / "fp8")
    checkpoint = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    for name, module in model.named_modules():
        if name.endswith("_proj") and f"{name}.weight_scale" in checkpoint:
            split = slices if name.endswith(("o_proj", "down_proj")) else 1
            _w8a8(module, checkpoint[f"{name}.weight"], checkpoint[f"{name}.weight_scale"], split)
    prompts = [[10 + i for i in range(n)] for n in (5, 23)]
    return checkpoint, prompts, hf_greedy(model, prompts, 10)


@pytest.mark.parametrize("method", ["compressed-tensors", "modelopt"])
def test_an_fp8_checkpoints_weights_are_served_as_they_are(
    method: str, default_model_dir: Path, tmp_path: Path
) -> None:
    """With ``--quantization fp8`` an FP8 checkpoint scaled by output channel
    (compressed-tensors) or by tensor (ModelOpt) keeps its FP8 bytes: the fused qkv and gate/up
    layers hold the parts' bytes and each part's scales on its rows; the engine's greedy tokens
    are transformers' with each projection computed W8A8 from those weights."""
    checkpoint, prompts, want = _fp8_reference(default_model_dir, tmp_path, method)
    llm = LLM(str(tmp_path / "fp8"), quantization="fp8", **SMALL)
    try:
        qkv = llm.engine.core.runner.model.layers[1].self_attn.qkv_proj
        parts = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
        w8 = torch.cat([checkpoint[f"{p}.weight"] for p in parts])
        assert torch.equal(qkv.weight.view(torch.uint8), w8.view(torch.uint8))
        rows = [checkpoint[f"{p}.weight"].shape[0] for p in parts]
        scales = torch.cat([checkpoint[f"{p}.weight_scale"].float().reshape(-1).expand(n)
                            for p, n in zip(parts, rows, strict=True)])  # fmt: skip
        assert torch.equal(qkv.weight_scale, scales)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [list(g.outputs[0].token_ids) for g in got] == want
    finally:
        llm.shutdown()


def test_two_ranks_quantize_their_own_slices(default_model_dir: Path, tmp_path: Path) -> None:
    """Split two ways (as vLLM splits FP8 layers): each rank's qkv and gate/up rows are the
    checkpoint's FP8 rows, with their scales; o_proj and down_proj take each rank's columns
    with the rows' whole scales, and each rank quantizes its own slice of their input. The
    tokens are transformers' W8A8 with those two products computed a slice at a time."""
    _, prompts, want = _fp8_reference(default_model_dir, tmp_path, "compressed-tensors", 2)
    got = greedy_tokens(tmp_path / "fp8", prompts, 10, kv_cache_memory=1 << 24,
                        tensor_parallel_size=2, quantization="fp8")  # fmt: skip
    assert got == want


def test_a_block_scaled_checkpoint_is_requantized_by_rows(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A checkpoint scaled by blocks (transformers' "fp8") with ``--quantization fp8``: its
    weights dequantized, then quantized a row at a time (its blocks' scales do not fit rows)."""
    model = build_model("llama", default_model_dir, tmp_path / "model")
    dequantized = _fp8_folder("fp8", model, tmp_path / "model", tmp_path / "fp8")
    llm = LLM(str(tmp_path / "fp8"), quantization="fp8", **SMALL)
    try:
        down = llm.engine.core.runner.model.layers[0].mlp.down_proj
        assert isinstance(down, Fp8Linear)
        w = dequantized["model.layers.0.mlp.down_proj.weight"]
        back = down.weight.float() * down.weight_scale.unsqueeze(1)
        assert (back - w).abs().max() <= w.abs().amax() * 2**-4
        (out,) = llm.generate([{"prompt_token_ids": [10, 11, 12]}], SamplingParams(max_tokens=4),
                              use_tqdm=False)  # fmt: skip
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


def test_dummy_weights_and_other_methods(default_model_dir: Path, tmp_path: Path) -> None:
    """``--load-format dummy`` draws FP8 layers too (quantized draws); ``--quantization``
    with an FP8 checkpoint's own method name needs an FP8 checkpoint; others are refused."""
    llm = LLM(str(default_model_dir), quantization="fp8", load_format="dummy", **SMALL)
    try:
        layers = fp8_layers(llm)
        assert len(layers) == 120
        assert all(bool((m.weight_scale > 0).all()) for m in layers)
        assert layers[0].weight.float().abs().amax() == 448.0
    finally:
        llm.shutdown()
    with pytest.raises(InvalidRequestError, match="quantization 'gptq' is not supported"):
        LLM(str(default_model_dir), quantization="gptq", **SMALL)
    with pytest.raises(InvalidRequestError, match="names an AWQ checkpoint's method"):
        LLM(str(default_model_dir), quantization="awq", **SMALL)
    with pytest.raises(InvalidRequestError, match="names an FP8 checkpoint's method"):
        LLM(str(default_model_dir), quantization="modelopt", **SMALL)
    model = build_model("llama", default_model_dir, tmp_path / "model")
    _fp8_folder("modelopt", model, tmp_path / "model", tmp_path / "fp8")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    llm = LLM(str(tmp_path / "fp8"), quantization="modelopt", **SMALL)
    try:
        assert len(fp8_layers(llm)) == 2 * 4
    finally:
        llm.shutdown()


def test_lora_adapters_apply_over_fp8_layers(default_model_dir: Path, tmp_path: Path) -> None:
    """An adapter on every projection over FP8 layers (its deltas in the model's dtype, from
    each projection's unquantized input): the float32 model with the adapter scores its own
    continuations within 0.3 nats a token of the FP8 one with it (measured 0.20), and less
    than half as far as the FP8 model without it (0.64)."""
    from lora_adapters import SHAPES, write_adapter

    from baton import LoRARequest

    folder = write_adapter(tmp_path / "every", rank=8, alpha=16, targets=tuple(SHAPES), seed=1)
    every = LoRARequest("every", 1, str(folder))
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    scores: dict[tuple[str | None, bool], list[list[float]]] = {}
    forced: list[list[int]] = []
    for quantization in (None, "fp8"):
        llm = LLM(str(default_model_dir), quantization=quantization, **SMALL, **lora)
        try:
            if not forced:
                outs = llm.generate(PROMPTS, greedy, lora_request=every, use_tqdm=False)
                tokenizer = llm.get_tokenizer()
                forced = [tokenizer(p).input_ids + list(o.outputs[0].token_ids)
                          for p, o in zip(PROMPTS, outs, strict=True)]  # fmt: skip
            for adapter in (every, None):
                scores[quantization, adapter is not None] = forced_logprobs(llm, forced, adapter)
        finally:
            llm.shutdown()

    def gap(a: list[list[float]], b: list[list[float]]) -> float:
        gaps = [abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]
        return sum(gaps) / len(gaps)

    want = scores[None, True]
    assert gap(scores["fp8", True], want) < 0.3
    assert gap(scores["fp8", True], want) < 0.5 * gap(scores["fp8", False], want)

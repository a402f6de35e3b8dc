"""The CPU engine runs a decode-only step's layers in one C++ call (csrc/decode_layers_cpu.cpp,
``CpuDecodeLayers``): the hidden states must equal the Python layer loop's bit for bit, for the
default model (with its own KV cache and with FP8 ones), for a model with a qkv bias (Qwen2) and
for one with sliding windows (Mistral), and the path must stay off where its kernels do not
apply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.sampling_params import SamplingParams
from baton_kernels.cpu_linear import vnni_ops
from baton_kernels.cpu_ops import load_cpu_ops

pytestmark = pytest.mark.skipif(
    load_cpu_ops() is None or vnni_ops() is None,
    reason="needs the C++ CPU kernels and an AVX512-BF16 CPU",
)


def engine(model: Path, **kwargs: Any) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(model), max_model_len=256, kv_cache_memory=32 << 20, **kwargs)
    )


def run_comparing_paths(core: EngineCore) -> int:
    """Generate with both paths computed at every decode-only step (one C++ call first, then the
    Python layers, which write the same K/V rows again); return how many steps were compared."""
    model = core.runner.model
    one_call = model.cpu_decode_layers
    assert one_call is not None
    layers_forward = model.forward
    compared = calls = 0

    def fast(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        return one_call(*args)

    def both(*args: Any) -> torch.Tensor:
        nonlocal compared
        out: torch.Tensor = layers_forward(*args)
        metadata = args[3]
        if metadata.num_decodes == metadata.num_reqs:
            model.cpu_decode_layers = None
            try:
                want = layers_forward(*args)
            finally:
                model.cpu_decode_layers = fast
            assert torch.equal(out, want)
            compared += 1
        return out

    model.forward = both  # type: ignore[method-assign]
    model.cpu_decode_layers = fast  # type: ignore[assignment]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # prompt lengths on both sides of block boundaries (16), so contexts span 1-8 blocks
    for i, n in enumerate((5, 15, 16, 17, 40, 100)):
        core.add_request(str(i), [100 + (7 * j + i) % 4000 for j in range(n)], params)
    while core.has_unfinished_requests():
        core.step()
    assert calls == compared  # every decode-only step took the one-call path
    return compared


def test_default_model_decode_steps_equal_the_python_layers(default_model_dir: Path) -> None:
    core = engine(default_model_dir)  # bf16: the default dtype on this CPU
    assert run_comparing_paths(core) >= 10


def random_model(kind: str, default_model_dir: Path, folder: Path, **config: Any) -> None:
    """A 2-layer transformers model of ``kind`` ("Qwen2", "Mistral") with random weights and
    the default model's tokenizer in ``folder``."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=49152,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,  # head size 64, two query heads per KV head
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        **config,
    )
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            (folder / f.name).write_bytes(f.read_bytes())


def test_qkv_bias_model_equals_the_python_layers(default_model_dir: Path, tmp_path: Path) -> None:
    random_model("Qwen2", default_model_dir, tmp_path)
    core = engine(tmp_path, dtype="bfloat16")
    assert core.runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert run_comparing_paths(core) >= 10


def test_sliding_window_model_equals_the_python_layers(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A Mistral-7B-v0.1 kind whose every layer attends to its last 20 tokens (the prompts
    reach 112): the one call reads each layer's window as the Python layers do."""
    random_model("Mistral", default_model_dir, tmp_path, sliding_window=20)
    core = engine(tmp_path, dtype="bfloat16")
    assert core.runner.model.cpu_decode_layers.windows == [20, 20]
    assert run_comparing_paths(core) >= 10


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_8bit_kv_cache_decode_steps_equal_the_python_layers(
    default_model_dir: Path, kv_cache_dtype: str
) -> None:
    """An FP8 KV cache: the one call writes and reads it with each layer's K and V scales (not
    1 here, as a checkpoint's calibrated ones) as the Python layers' kernels do."""
    core = engine(default_model_dir, kv_cache_dtype=kv_cache_dtype)
    runner = core.runner
    assert runner.backend.name == "cpu"
    runner.kv_caches = [
        cache._replace(k_scale=0.5 + i / 10, v_scale=2.0 - i / 20)
        for i, cache in enumerate(runner.kv_caches)
    ]
    assert run_comparing_paths(core) >= 10


def test_off_where_its_kernels_do_not_apply(default_model_dir: Path) -> None:
    assert engine(default_model_dir, dtype="float32").runner.model.cpu_decode_layers is None
    reference = engine(default_model_dir, attention_backend="torch")
    assert reference.runner.model.cpu_decode_layers is None


def test_bad_input_is_a_clear_error() -> None:
    ops = load_cpu_ops()
    hidden = torch.zeros(2, 64, dtype=torch.bfloat16)
    idx = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="weight tensors per layer"):
        ops.decode_layers(
            hidden, idx, torch.zeros(8, 2, 64), [hidden], [torch.zeros(1, 2, 16, 1, 64)],
            idx, idx, idx.view(2, 1), idx, 1, 1, 64, 128, 1e-5, 0.125, [],
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="kv_scales: K's and V's per layer or none"):
        ops.decode_layers(
            hidden, idx, torch.zeros(8, 2, 64), [hidden] * 7, [torch.zeros(1, 2, 16, 1, 64)],
            idx, idx, idx.view(2, 1), idx, 1, 1, 64, 128, 1e-5, 0.125, [], [1.0],
        )  # fmt: skip

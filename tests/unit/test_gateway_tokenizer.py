"""The gateway's tokenizer: read from a GGUF's metadata (no torch) it equals the converted one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from baton_engine.model_files import (
    converted_model_dir,
    default_model_path,
    load_gguf_tokenizer,
    load_model_tokenizer,
    served_model_name,
)
from baton_gateway.chat import render_chat_prompt
from baton_gateway.errors import GatewayError
from baton_gateway.protocol import ChatCompletionRequest

TEXTS = ["The capital of France is Paris.", "Ünïcödé 你好 🙂", "  two  spaces\tand\ttabs\n", ""]


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Any:
    return load_gguf_tokenizer(default_model_path())


def test_gguf_tokenizer_equals_the_converted_one(gguf_tokenizer: Any, tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert gguf_tokenizer.encode(text, add_special_tokens=False) == ids
        assert gguf_tokenizer.decode(ids) == text
    assert gguf_tokenizer.chat_template == tokenizer.chat_template
    assert gguf_tokenizer.eos_token_id == tokenizer.eos_token_id
    assert sorted(gguf_tokenizer.all_special_ids) == sorted(tokenizer.all_special_ids)
    assert len(gguf_tokenizer) == len(tokenizer)


def test_model_tokenizer_without_conversion(tmp_path: Path, default_model_dir: Path) -> None:
    assert converted_model_dir(None, cache_dir=tmp_path) is None  # empty cache: not converted
    tok = load_model_tokenizer(None, cache_dir=tmp_path)
    assert tok.encode("hi there") == load_model_tokenizer(str(default_model_dir)).encode("hi there")
    assert not list(tmp_path.iterdir())  # nothing was written
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/m/Foo-1B.Q4.gguf") == "Foo-1B.Q4"
    assert served_model_name(str(default_model_dir)) == default_model_dir.name


def test_chat_template_rendering(tokenizer: Any) -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ]
        }
    )
    text = render_chat_prompt(tokenizer, request)
    assert "<|im_start|>user\na\nb<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    image = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    with pytest.raises(GatewayError, match="not supported") as e:
        render_chat_prompt(tokenizer, image)
    assert e.value.status == 400


def test_broken_or_hostile_template_is_a_400(tokenizer: Any) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    original = tokenizer.chat_template
    try:
        for template in (
            "{% for m in messages %}{{ m.content ",  # syntax error
            "{{ raise_exception('no') }}",
            # The sandbox refuses to reach Python internals from a template.
            "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        ):
            tokenizer.chat_template = template
            with pytest.raises(GatewayError) as e:
                render_chat_prompt(tokenizer, request)
            assert e.value.status == 400
    finally:
        tokenizer.chat_template = original

"""vLLM's prompt embeddings over HTTP (``baton serve --enable-prompt-embeds``): base64
``torch.save`` tensors in ``/v1/completions``' ``prompt_embeds``, prefilled on the prefill
worker and their KV pulled by the decode worker, answer as the same prompt's tokens do."""

from __future__ import annotations

import base64
import io
import signal
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors import safe_open

pytestmark = pytest.mark.integration

PROMPT = (
    "Here is a short story about a lighthouse keeper who finds a message in a bottle on the "
    "shore one stormy evening, and what she decides to do about it:"
)


def _encoded(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _decode_counter(metrics: str, name: str) -> float:
    """The sum of a counter's samples over the decode worker's series."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name) and 'role="decode"' in line
    )


def test_completions_take_prompt_embeds(
    serve_launcher: Any, default_model_dir: Path, tokenizer: Any
) -> None:
    """Disaggregated (every prompt prefilled remotely): a prompt's tokens' embeddings answer
    with the tokens' text, streamed or not, with logprobs and n, usage counting their rows;
    several embeddings and text prompts in one request answer the embeddings first; a
    bfloat16 tensor and a view into a batch are taken; bad embeddings get 400s in words."""
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as weights:
        table = weights.get_tensor("model.embed_tokens.weight")
    ids = tokenizer.encode(PROMPT)
    other = tokenizer.encode("The three primary colours are")
    server = serve_launcher.start(
        ["--dtype", "float32", "--enable-prompt-embeds", "--remote-prefill-threshold", "0"]
    )
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        model = client.models.list().data[0].id

        def complete(**kwargs: Any) -> Any:
            return client.completions.create(model=model, max_tokens=8, temperature=0.0, **kwargs)

        want = complete(prompt=ids).choices[0].text
        want_other = complete(prompt=other).choices[0].text
        embeds = _encoded(table[ids])
        got = complete(prompt="", extra_body={"prompt_embeds": embeds})
        assert got.choices[0].text == want
        assert got.usage is not None and got.usage.prompt_tokens == len(ids)
        metrics = httpx.get(f"{server.root_url}/metrics", timeout=10).text
        assert _decode_counter(metrics, "baton:kv_transfer_blocks_total") >= len(ids) // 16
        stream = complete(prompt="", stream=True, extra_body={"prompt_embeds": embeds})
        assert "".join(chunk.choices[0].text for chunk in stream) == want
        scored = complete(prompt="", logprobs=2, n=2, extra_body={"prompt_embeds": embeds})
        for choice in scored.choices:
            assert choice.text == want and choice.logprobs is not None
            assert len(choice.logprobs.token_logprobs) == 8
            assert all(len(top) >= 2 for top in choice.logprobs.top_logprobs)
        # embeddings first, then the text prompts (vLLM's order)
        batch = [table[other][None], table[ids]]  # ([1, length, hidden]: a batch of one)
        mixed = complete(prompt="Hi", extra_body={"prompt_embeds": list(map(_encoded, batch))})
        texts = [c.text for c in sorted(mixed.choices, key=lambda c: c.index)]
        assert texts == [want_other, want, complete(prompt="Hi").choices[0].text]
        # another dtype (converted to the model's) and a view into a padded batch
        padded = torch.zeros(2, len(ids) + 3, table.shape[1])
        padded[1, 3:] = table[ids]
        for tensor in (table[ids].to(torch.bfloat16), padded[1, 3:]):
            text = complete(prompt="", extra_body={"prompt_embeds": _encoded(tensor)})
            assert text.choices[0].text, text
        assert (
            complete(prompt="", extra_body={"prompt_embeds": _encoded(padded[1, 3:])})
            .choices[0]
            .text
            == want
        )

        bad = [
            ({"prompt_embeds": "not base64!"}, "base64"),
            ({"prompt_embeds": _encoded({"x": table[ids]})}, "one tensor saved with torch.save"),
            ({"prompt_embeds": _encoded(torch.ones(3, 4))}, r"\[prompt length, 576\]"),
            ({"prompt_embeds": _encoded(torch.ones(2, 576, dtype=torch.int32))}, "int32"),
            ({"prompt_embeds": embeds, "prompt_logprobs": 1}, "not compatible"),
            ({"prompt_embeds": embeds, "echo": True}, "Echo is unsupported"),
        ]
        for extra, message in bad:
            with pytest.raises(openai.BadRequestError, match=message):
                complete(prompt="", extra_body=extra)
        assert complete(prompt=ids).choices[0].text == want  # (still serving)
    finally:
        _, survivors = serve_launcher.stop(server, signal.SIGTERM)
    assert not survivors, f"left behind: {survivors}"


def test_prompt_embeds_need_the_flag(client: openai.OpenAI) -> None:
    """Without ``--enable-prompt-embeds`` a prompt's embeddings are a 400 naming the flag."""
    with pytest.raises(openai.BadRequestError, match="--enable-prompt-embeds"):
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt="",
            max_tokens=4,
            extra_body={"prompt_embeds": _encoded(torch.ones(3, 576))},
        )

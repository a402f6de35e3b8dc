"""vLLM's prompt embeddings: a prompt given as the model's input embeddings, one row a position,
instead of token ids (``--enable-prompt-embeds``; ``LLM.generate({"prompt_embeds": t})``, the
completions API's base64 ``torch.save`` tensors).

A row is what Hugging Face's ``model.get_input_embeddings()(ids)`` gives for a token (as
transformers' ``inputs_embeds`` and vLLM's): Granite's ``embedding_multiplier`` applies to it as
to a token's embedding; Gemma's sqrt(hidden) is part of that lookup, so its rows come scaled.
The engine keeps the rows in the model's dtype on the host; the runner moves them to the device
and writes them over the step's token embeddings.

Each row gets an id (``row_ids``): negative, so never a token, and a digest of the row's bytes,
so that blocks are hashed (prefix caching, the kvstore's prefix index) from what they hold:
equal rows share KV, other rows never do.
"""

from __future__ import annotations

import hashlib

import torch

from baton_engine.errors import InvalidRequestError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def checked(embeds: object, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``embeds`` as a [rows, hidden_size] contiguous tensor of ``dtype`` on the host; a
    [1, rows, hidden_size] tensor (a batch of one) is taken too. Raises InvalidRequestError."""
    if not isinstance(embeds, torch.Tensor):
        raise InvalidRequestError(
            f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}"
        )
    if embeds.layout != torch.strided or embeds.is_quantized:
        raise InvalidRequestError("prompt_embeds must be a dense tensor")
    if embeds.dtype not in DTYPES.values():
        raise InvalidRequestError(
            f"prompt_embeds of dtype {str(embeds.dtype).removeprefix('torch.')} are not "
            f"supported (supported: {', '.join(DTYPES)})"
        )
    if embeds.dim() == 3 and embeds.shape[0] == 1:
        embeds = embeds[0]
    if embeds.dim() != 2 or embeds.shape[1] != hidden_size:
        raise InvalidRequestError(
            f"prompt_embeds must have the shape [prompt length, {hidden_size}] (the model's "
            f"hidden size), got {list(embeds.shape)}"
        )
    if embeds.shape[0] == 0:
        raise InvalidRequestError("the prompt is empty")
    return embeds.detach().to("cpu", dtype).contiguous()


def from_raw(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor of raw row-major little-endian ``data`` (the gateway's ``RawTensor``, sent
    over gRPC). Raises InvalidRequestError for a dtype or length that does not fit."""
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise InvalidRequestError(
            f"prompt_embeds of dtype {dtype!r} are not supported (supported: {', '.join(DTYPES)})"
        )
    numel = 1
    for n in shape:
        numel *= n
    if any(n < 0 for n in shape) or len(data) != numel * torch_dtype.itemsize:
        raise InvalidRequestError(
            f"prompt_embeds of shape {list(shape)} and dtype {dtype} need "
            f"{numel * torch_dtype.itemsize} bytes, got {len(data)}"
        )
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    return torch.frombuffer(bytearray(data), dtype=torch_dtype).view(shape)


def row_ids(embeds: torch.Tensor) -> list[int]:
    """An id for each row of ``checked`` embeddings: minus one minus 56 bits of the digest of
    its bytes."""
    raw = embeds.view(torch.uint8).numpy()
    return [
        -1 - int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=7).digest(), "little")
        for row in raw
    ]

"""LoRA adapters offline (``LLM(enable_lora=True)``, ``LoRARequest``), as vLLM serves them.

The reference is Hugging Face transformers with each adapter merged into its weights
(``W + scale * B @ A``): a request with an adapter must generate what the merged model does,
token for token (float32), whatever it shares a batch with (other adapters, the base model),
however its prompt is chunked, and whether or not the adapters fit the device slots at once.
The adapters are written here, PEFT's format, with random weights large enough to change the
model's answers.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from lora_adapters import SHAPES, write_adapter
from safetensors.torch import save_file

from baton import LLM, LoRARequest, SamplingParams
from baton_engine.errors import InvalidRequestError, NotFoundError

NUM_NEW_TOKENS = 12
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    # longer than a step's budget (48 tokens): computed in chunks
    " ".join(f"Item {i} is a {c} box." for i, c in enumerate(["red", "blue", "green"] * 5)),
]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    every = write_adapter(
        root / "every", rank=8, alpha=16, targets=tuple(SHAPES), seed=1
    )  # every projection
    attn = write_adapter(
        root / "attn", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2, rslora=True,
        binary=True,
    )  # fmt: skip
    mlp = write_adapter(root / "mlp", rank=8, alpha=8, targets=("down_proj",), seed=3)
    return {
        "every": LoRARequest("every", 1, str(every)),
        "attn": LoRARequest("attn", 2, str(attn)),
        "mlp": LoRARequest("mlp", 3, str(mlp)),
    }


def merged_scale(request: LoRARequest) -> tuple[float, dict[str, torch.Tensor]]:
    folder = Path(request.lora_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    r, alpha = config["r"], config["lora_alpha"]
    scale = alpha / (r**0.5 if config["use_rslora"] else r)
    if (folder / "adapter_model.bin").exists():
        return scale, torch.load(folder / "adapter_model.bin", weights_only=True)
    from safetensors.torch import load_file

    return scale, load_file(str(folder / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def reference(
    tokenizer: Any, adapters: dict[str, LoRARequest], hf_model: Any
) -> dict[str | None, list[list[int]]]:
    """transformers' greedy tokens for each prompt, with each adapter merged into a copy of
    the weights (None: the base model)."""
    out: dict[str | None, list[list[int]]] = {}
    for name in (None, *adapters):
        model = hf_model
        if name is not None:
            model = copy.deepcopy(hf_model)
            scale, tensors = merged_scale(adapters[name])
            params = dict(model.named_parameters())
            with torch.no_grad():
                for key, a in tensors.items():
                    if ".lora_A." not in key:
                        continue
                    b = tensors[key.replace(".lora_A.", ".lora_B.")]
                    target = key.removeprefix("base_model.model.").replace(".lora_A", "")
                    params[target] += scale * (b @ a)
        tokens = []
        with torch.inference_mode():
            for text in PROMPTS:
                ids = torch.tensor([tokenizer(text).input_ids])
                gen = model.generate(ids, max_new_tokens=NUM_NEW_TOKENS, do_sample=False)
                tokens.append(gen[0, ids.shape[1] :].tolist())
        out[name] = tokens
    return out


def make_llm(model_dir: Path, **kwargs: Any) -> LLM:
    # float32, as the reference; a step takes at most 48 tokens (the long prompt is chunked)
    args: dict[str, Any] = dict(
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=48,
        kv_cache_memory=64 << 20,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    return LLM(str(model_dir), **(args | kwargs))


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return make_llm(default_model_dir)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)


def run_mixed(llm: LLM, adapters: dict[str, LoRARequest]) -> dict[str | None, list[list[int]]]:
    """Every prompt with every adapter and with none, all in one batch."""
    names: list[str | None] = [None, *adapters]
    prompts = [p for _ in names for p in PROMPTS]
    loras = [None if n is None else adapters[n] for n in names for _ in PROMPTS]
    outs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    k = len(PROMPTS)
    return {name: tokens[i * k : (i + 1) * k] for i, name in enumerate(names)}


def test_adapters_generate_what_their_merged_weights_do(
    llm: LLM,
    adapters: dict[str, LoRARequest],
    reference: dict[str | None, list[list[int]]],
) -> None:
    # three adapters and the base model in one batch, with two device slots: the scheduler
    # holds back the third adapter's requests until a slot's requests are done
    got = run_mixed(llm, adapters)
    for name in (None, *adapters):
        assert got[name] == reference[name], name
        if name is not None:  # the adapter changes the answers
            assert got[name] != reference[None], name
    # one adapter alone (every token one slot) and one request alone
    (alone,) = llm.generate(PROMPTS[0], GREEDY, lora_request=adapters["every"], use_tqdm=False)
    assert list(alone.outputs[0].token_ids) == reference["every"][0]


def test_one_device_slot(
    default_model_dir: Path,
    adapters: dict[str, LoRARequest],
    reference: dict[str | None, list[list[int]]],
) -> None:
    """With ``max_loras=1`` a step holds one adapter's requests (and the base model's): the
    others wait, and every answer is still its adapter's."""
    llm = make_llm(default_model_dir, max_loras=1, max_cpu_loras=1)
    assert run_mixed(llm, adapters) == reference


def test_prefix_cache_is_per_adapter(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    """A prompt's KV computed with one adapter is not reused for another or for the base
    model (their KV differs), but is for the same adapter."""
    prompt = "A prefix long enough to fill a few blocks of sixteen tokens: " * 3
    params = SamplingParams(temperature=0.0, max_tokens=2)
    (first,) = llm.generate(prompt, params, lora_request=adapters["every"], use_tqdm=False)
    (other,) = llm.generate(prompt, params, lora_request=adapters["attn"], use_tqdm=False)
    (base,) = llm.generate(prompt, params, use_tqdm=False)
    (again,) = llm.generate(prompt, params, lora_request=adapters["every"], use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    full_blocks = (len(first.prompt_token_ids or []) - 1) // 16  # (one token is computed)
    assert full_blocks >= 2 and again.num_cached_tokens == 16 * full_blocks
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_embeddings_with_an_adapter(llm: LLM, adapters: dict[str, LoRARequest]) -> None:
    (base,) = llm.embed(PROMPTS[0], use_tqdm=False)
    (lora,) = llm.embed(PROMPTS[0], lora_request=adapters["every"], use_tqdm=False)
    (again,) = llm.embed(PROMPTS[0], lora_request=adapters["every"], use_tqdm=False)
    cos = sum(a * b for a, b in zip(base.outputs.embedding, lora.outputs.embedding, strict=True))
    assert cos < 0.99
    torch.testing.assert_close(
        torch.tensor(again.outputs.embedding), torch.tensor(lora.outputs.embedding)
    )


def test_lora_errors(
    llm: LLM, adapters: dict[str, LoRARequest], tmp_path: Path, default_model_dir: Path
) -> None:
    def refused(request: LoRARequest, match: str) -> None:
        with pytest.raises(InvalidRequestError, match=match):
            llm.generate("hi", GREEDY, lora_request=request, use_tqdm=False)

    refused(LoRARequest("nowhere", 9, str(tmp_path / "missing")), "no adapter_config.json")
    wide = write_adapter(tmp_path / "wide", rank=16, alpha=16, targets=("q_proj",), seed=4)
    refused(LoRARequest("wide", 9, str(wide)), "rank 16 is above max_lora_rank 8")
    dora = write_adapter(
        tmp_path / "dora", rank=4, alpha=4, targets=("q_proj",), seed=5, extra={"use_dora": True}
    )
    refused(LoRARequest("dora", 9, str(dora)), "DoRA")
    embed = write_adapter(tmp_path / "embed", rank=4, alpha=4, targets=("q_proj",), seed=6)
    save_file(
        {"base_model.model.model.embed_tokens.lora_A.weight": torch.ones(4, 49152)},
        str(embed / "adapter_model.safetensors"),
    )
    refused(LoRARequest("embed", 9, str(embed)), "not a LoRA weight of a supported projection")
    refused(LoRARequest("every", 1, str(adapters["attn"].lora_path)), "is loaded from")
    with pytest.raises(InvalidRequestError, match="lora_int_id must be at least 1"):
        LoRARequest("zero", 0, "x")
    with pytest.raises(InvalidRequestError, match="got 1 prompts but 2 LoRA requests"):
        llm.generate("hi", GREEDY, lora_request=[adapters["every"]] * 2, use_tqdm=False)
    # a bad request leaves the others' answers intact
    (ok,) = llm.generate(PROMPTS[0], GREEDY, lora_request=adapters["every"], use_tqdm=False)
    assert ok.finished


def test_adapters_load_and_unload_at_run_time(
    llm: LLM, adapters: dict[str, LoRARequest], reference: dict[str | None, list[list[int]]]
) -> None:
    """What a worker does for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: an
    adapter served by name from then on, then no more."""
    core = llm.engine.core
    path = adapters["mlp"].lora_path
    loaded = core.load_lora_adapter("late", path)
    assert core.lora_request("late") == loaded
    (out,) = llm.generate(PROMPTS[0], GREEDY, lora_request=loaded, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference["mlp"][0]
    with pytest.raises(InvalidRequestError, match="has already been loaded"):
        core.load_lora_adapter("late", path)
    with pytest.raises(InvalidRequestError, match=r"no adapter_config\.json"):
        core.load_lora_adapter("broken", path + "-missing")
    core.unload_lora_adapter("late")
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'late'"):
        core.lora_request("late")
    with pytest.raises(NotFoundError, match="cannot be found"):
        core.unload_lora_adapter("late")
    # the name may serve another adapter now
    other = core.load_lora_adapter("late", adapters["every"].lora_path)
    (out,) = llm.generate(PROMPTS[0], GREEDY, lora_request=other, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == reference["every"][0]
    core.unload_lora_adapter("late")


def test_lora_needs_enable_lora(default_model_dir: Path, adapters: dict[str, LoRARequest]) -> None:
    llm = LLM(str(default_model_dir), max_model_len=64, kv_cache_memory=16 << 20)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate("hi", GREEDY, lora_request=adapters["every"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="max_loras must be at least 1"):
        LLM(str(default_model_dir), enable_lora=True, max_loras=0)


@pytest.mark.parametrize(
    ("arch", "shapes"),
    [  # Phi-3's q/k/v and gate/up fused (PEFT adapts them as one); Granite's residual multiplier
        ("phi3", {"qkv_proj": (64, 128), "o_proj": (64, 64), "gate_up_proj": (64, 256),
                  "down_proj": (128, 64)}),
        # half of each head turned: the q and k rows of its adapters reordered as the model's
        ("phi3-partial-rotary", {"qkv_proj": (64, 128), "o_proj": (64, 64)}),
        ("granite", {"q_proj": (64, 64), "o_proj": (64, 64), "down_proj": (128, 64)}),
        # Gemma 2's outputs normed before the residual adds, its scores and logits capped (its
        # heads of 256)
        ("gemma2", {"q_proj": (64, 1024), "o_proj": (1024, 64), "down_proj": (128, 64)}),
    ],
)  # fmt: skip
def test_adapters_on_other_architectures(
    arch: str, shapes: dict[str, tuple[int, int]], default_model_dir: Path, tmp_path: Path
) -> None:
    """An adapter generates what transformers does with it merged into the weights: on Phi-3's
    fused projections (and with a partial rotation), on Granite's, whose outputs the residual
    multiplier scales, and on Gemma 2's, whose outputs are normed."""
    from lora_adapters import merged_greedy
    from tiny_models import build_model

    model = build_model(arch, default_model_dir, tmp_path / "model")
    adapter = write_adapter(tmp_path / "adapter", rank=4, alpha=8, targets=tuple(shapes),
                            seed=7, shapes=shapes, num_layers=2, scale=0.3)  # fmt: skip
    prompts = [[10 + i for i in range(n)] for n in (5, 23)]
    want = merged_greedy(model, adapter, prompts, NUM_NEW_TOKENS)
    llm = LLM(str(tmp_path / "model"), dtype="float32", max_model_len=256,
              kv_cache_memory=16 << 20, enable_lora=True, max_lora_rank=8)  # fmt: skip
    try:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        base = llm.generate(inputs, GREEDY, use_tqdm=False)
        got = llm.generate(inputs, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))
        assert [list(g.outputs[0].token_ids) for g in got] == want
        assert want != [list(b.outputs[0].token_ids) for b in base]
    finally:
        llm.shutdown()

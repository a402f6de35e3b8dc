"""The engine on a GPU: CUDA-graph decode with the Triton backend gives the reference backend's
greedy tokens (float32, dummy weights), KV sizing leaves the pool what the profile allows, and
the log reports it. Run on a GPU machine with ``pytest -m gpu``."""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 448,  # 7 query heads per KV head, as Qwen2.5-0.5B
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 7,
    "num_key_value_heads": 1,
    "vocab_size": 4096,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}


def _core(model_dir: Path, **overrides: object) -> Any:
    """An engine on the GPU for the dummy-weight model in ``model_dir`` (float32)."""
    from baton_engine.config import EngineConfig
    from baton_engine.core.engine_core import EngineCore

    config: dict[str, Any] = dict(
        model=str(model_dir),
        load_format="dummy",
        dtype="float32",
        device="cuda",
        gpu_memory_utilization=0.3,
    )
    config.update(overrides)
    _release_memory()  # an earlier test's engine (reference cycles) must not count as in use
    return EngineCore(EngineConfig(**config))


def _drain(core: Any) -> dict[str, list[int]]:
    """Step until every request is done: each request's tokens; the pool checked whole."""
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    core.check_invariants()
    return tokens


def _release_memory() -> None:
    """After ``del`` of an engine: its KV pool goes before the next engine sizes its own."""
    gc.collect()
    torch.cuda.empty_cache()


def _run(
    model_dir: Path,
    backend: str,
    enforce_eager: bool,
    async_scheduling: bool | None = None,
    **overrides: object,
) -> tuple[dict[str, list[int]], Any]:
    from baton_engine.sampling_params import SamplingParams

    core = _core(
        model_dir,
        max_model_len=1024,
        max_num_seqs=24,
        attention_backend=backend,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        **overrides,
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for i in range(19):  # 19 decodes: padded to the captured size 24
        prompt = torch.randint(1, 4000, (20 + 37 * i,), generator=g).tolist()
        core.add_request(f"r{i}", prompt, params)
    return _drain(core), core


def test_graph_decode_matches_reference(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    # the reference: torch attention and ops, eager, synchronous; against the GPU's defaults:
    # Triton attention and fused kernels, CUDA graphs, async scheduling
    want = _run(tmp_path, "torch", enforce_eager=True, async_scheduling=False)[0]
    _release_memory()
    with caplog.at_level("INFO"):
        got, core = _run(tmp_path, "triton", enforce_eager=False)
    assert got == want
    graphs = core.runner.graphs
    assert graphs is not None and graphs._graphs, "no CUDA graph was captured"
    assert graphs.num_steps.get(24, 0) > 0
    pieces = core.runner.pieces  # the prompt steps, piecewise from captured graphs
    assert pieces is not None and len(pieces._graphs) == len(pieces.sizes)
    assert sum(pieces.num_steps.values()) > 0
    assert core.async_scheduling and core.runner.model.fused_rope
    assert core.runner.model.folded_norms  # decode steps without the norms' kernels
    assert any("KV cache:" in r.getMessage() and "blocks" in r.getMessage() for r in caplog.records)
    total = torch.cuda.get_device_properties(0).total_memory
    pool_bytes = core.kv_pool.numel() * core.kv_pool.element_size()
    assert 0 < pool_bytes < 0.3 * total


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_8bit_cache_on_the_gpus_defaults_matches_reference(
    kv_cache_dtype: str, tmp_path: Path
) -> None:
    """``--kv-cache-dtype fp8``: the Triton kernels (the rotary kernel's and the decode
    kernel's cache writes, both attentions' reads) through CUDA graphs give the greedy tokens
    of the reference backend over the same 8-bit cache, whose pool holds 8-bit floats."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    want, ref = _run(
        tmp_path, "torch", enforce_eager=True, async_scheduling=False,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    assert ref.kv_pool.element_size() == 1
    del ref
    _release_memory()
    got, core = _run(tmp_path, "triton", enforce_eager=False, kv_cache_dtype=kv_cache_dtype)
    assert got == want
    assert core.runner.graphs is not None and core.runner.graphs.num_steps.get(24, 0) > 0
    assert (
        core.kv_pool.dtype
        == {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    )


def test_fp8_layers_on_the_gpus_defaults_match_reference(tmp_path: Path) -> None:
    """``--quantization fp8``: the projections are FP8 layers (the GPU's FP8 GEMMs, the
    Triton quantization and few-row kernels), captured in the decode graphs and the prompt
    steps' pieces: the graphs give the eager steps' tokens, and those are the eager torch
    reference's over the same FP8 layers, but where the activations' rounding to FP8 turns a
    float32 difference of the two attentions into a step of FP8 (measured on an H100: 17 of
    19 requests equal throughout, 1 differing from its first token)."""
    from baton_kernels.fp8_linear import Fp8Linear

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    want, ref = _run(tmp_path, "torch", enforce_eager=True, async_scheduling=False,
                     quantization="fp8")  # fmt: skip
    down = ref.runner.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.weight.dtype == torch.float8_e4m3fn
    del ref, down
    _release_memory()
    eager = _run(tmp_path, "triton", enforce_eager=True, async_scheduling=False,
                 quantization="fp8")[0]  # fmt: skip
    _release_memory()
    got, core = _run(tmp_path, "triton", enforce_eager=False, quantization="fp8")
    assert core.runner.graphs is not None and core.runner.graphs.num_steps.get(24, 0) > 0
    pieces = core.runner.pieces
    assert pieces is not None and sum(pieces.num_steps.values()) > 0
    assert not core.runner.model.folded_norms  # (the fold reads 16-bit weights)
    assert got == eager
    assert sum(got[r][0] != want[r][0] for r in want) <= 2
    same = [next((i for i, (a, b) in enumerate(zip(got[r], want[r], strict=True)) if a != b),
                 len(want[r])) for r in want]  # fmt: skip
    assert sum(same) >= 0.75 * sum(len(t) for t in want.values()), same


def test_embeddings_match_reference(tmp_path: Path) -> None:
    """Embedding requests among generating ones on the GPU's defaults (Triton attention,
    graphs, piecewise prompt graphs, async scheduling) pool what the eager torch reference
    pools, and leave the generated tokens as they were: a long prompt in chunks, a one-token
    prompt in a step of decodes (no graph may take it), both under async scheduling."""
    from baton_engine.pooling_params import PoolingParams
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    embed_prompts = {"e-long": [(5 * j) % 4000 + 1 for j in range(700)], "e-one": [42]}
    embed_prompts |= {
        f"e{i}": [(11 * i + j) % 4000 + 1 for j in range(3 + 9 * i)] for i in range(6)
    }
    results = []
    for backend, eager, async_scheduling in (("torch", True, False), ("triton", False, None)):
        core = _core(
            tmp_path,
            max_model_len=1024,
            max_num_seqs=16,
            max_num_batched_tokens=256,
            attention_backend=backend,
            enforce_eager=eager,
            async_scheduling=async_scheduling,
        )
        for i in range(8):
            core.add_request(f"g{i}", [(13 * i + j) % 4000 + 1 for j in range(5 + 7 * i)], params)
        tokens: dict[str, list[int]] = {}
        pooled: dict[str, list[float]] = {}
        for step in range(10_000):  # bounded: ~30 steps
            if step == 2:  # the generating requests decode by now: a step of one token each
                core.add_request("e-one", embed_prompts["e-one"], PoolingParams())
            elif step == 3:
                for req_id, prompt in embed_prompts.items():
                    if req_id != "e-one":
                        core.add_request(req_id, prompt, PoolingParams())
            elif step > 3 and not core.has_unfinished_requests():
                break
            for out in core.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
                if out.pooled is not None:
                    pooled[out.req_id] = out.pooled
        core.check_invariants()
        results.append((tokens, pooled))
        del core
        _release_memory()
    (want_tokens, want_pooled), (got_tokens, got_pooled) = results
    assert got_tokens == want_tokens and sorted(got_pooled) == sorted(embed_prompts)
    for req_id, want in want_pooled.items():
        assert got_tokens[req_id] == []  # an embedding's token is no output
        torch.testing.assert_close(
            torch.tensor(got_pooled[req_id]), torch.tensor(want), atol=1e-4, rtol=1e-3
        )


def test_a_classifier_on_the_gpus_defaults_matches_reference(tmp_path: Path) -> None:
    """A sequence-classification model (its head of 3 labels in place of the LM head) on the
    GPU's defaults (Triton attention, CUDA graphs captured at start, async scheduling) gives
    the eager torch reference's probabilities, for prompts chunked and not."""
    from baton_engine.pooling_params import PoolingParams

    config = {**CONFIG, "architectures": ["Qwen2ForSequenceClassification"]}
    config |= {"num_labels": 3, "id2label": {"0": "a", "1": "b", "2": "c"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompts = {f"c{i}": [(7 * i + j) % 4000 + 1 for j in range(2 + 150 * i)] for i in range(4)}
    results = []
    for backend, eager, async_scheduling in (("torch", True, False), ("triton", False, None)):
        core = _core(
            tmp_path,
            max_model_len=1024,
            max_num_batched_tokens=256,
            attention_backend=backend,
            enforce_eager=eager,
            async_scheduling=async_scheduling,
        )
        assert core.model_config.labels == ("a", "b", "c")
        for req_id, prompt in prompts.items():
            core.add_request(req_id, prompt, PoolingParams())
        probs: dict[str, list[float]] = {}
        for _ in range(10_000):  # bounded: a few steps
            if not core.has_unfinished_requests():
                break
            for out in core.step():
                if out.pooled is not None:
                    probs[out.req_id] = out.pooled
        core.check_invariants()
        results.append(probs)
        del core
        _release_memory()
    want, got = results
    assert sorted(got) == sorted(prompts)
    for req_id, p in want.items():
        assert abs(sum(p) - 1.0) < 1e-4
        torch.testing.assert_close(torch.tensor(got[req_id]), torch.tensor(p), atol=1e-4, rtol=1e-3)


def test_async_sampling_equals_sync(tmp_path: Path) -> None:
    """Seeded random sampling, penalties and logprobs on the GPU's defaults (graphs, fused
    kernels) give the same tokens with and without async scheduling."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    kinds = [
        SamplingParams(
            temperature=0.9, top_p=0.9, top_k=50, seed=1, max_tokens=20, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.7, seed=2, max_tokens=20, repetition_penalty=1.2, ignore_eos=True
        ),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(
            temperature=1.0, min_p=0.05, seed=3, max_tokens=20, min_tokens=5
        ),  # EOS may end it
    ]
    results = []
    for async_scheduling in (False, True):
        core = _core(
            tmp_path, max_model_len=512, max_num_seqs=16, async_scheduling=async_scheduling
        )
        for i in range(12):
            core.add_request(f"s{i}", [(17 * i + j) % 4000 + 1 for j in range(9 + i)], kinds[i % 4])
        results.append(_drain(core))
        del core
        _release_memory()
    assert results[1] == results[0]
    assert all(len(t) == 20 for k, t in results[0].items() if int(k[1:]) % 4 != 3)


def test_async_long_chunked_prompt_equals_sync(tmp_path: Path) -> None:
    """A long prompt alone, chunked over many steps that sample nothing: the host is not held
    back by any sampled token then, and must still not overwrite the pinned inputs of a step
    whose copies have not run."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        core = _core(
            tmp_path,
            max_model_len=4096,
            max_num_seqs=4,
            max_num_batched_tokens=128,  # a 3,000-token prompt: 24 steps without a sample
            async_scheduling=async_scheduling,
        )
        core.add_request("long", [(7 * j) % 4000 + 1 for j in range(3000)], params)
        results.append(_drain(core)["long"])
        del core
        _release_memory()
    assert results[1] == results[0] and len(results[0]) == 8


@pytest.mark.parametrize(("whole_layers", "dot"), [(True, False), (False, False), (False, True)])
def test_lone_request_decodes_through_fused_gemv_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, whole_layers: bool, dot: bool
) -> None:
    """A small model on the GPU turns on the fused GEMV layers for one-request decode steps
    (captured in the size-1 graph); a lone request's greedy tokens equal the reference's.
    Above ``GEMV_MAX_HIDDEN`` (lowered here) only the attention's projections are GEMVs; with
    ``dot`` every projection (gate_up too) runs compiled on the tensor-core GEMV, as Llama-3.1-8B's
    long ones do, some split over K."""
    from baton_engine.runner import model_runner
    from baton_engine.sampling_params import SamplingParams

    if not whole_layers:
        monkeypatch.setattr(model_runner, "GEMV_MAX_HIDDEN", 0)
    if dot:
        from baton_kernels.triton import gemv

        h, inter, kv = 448, 1024, 64  # CONFIG's hidden, intermediate and one KV head's size
        launches = {(h + 2 * kv, h): (64, 64, 4, 3, 2), (h, h): (64, 128, 4, 3, 1),
                    (2 * inter, h): (128, 64, 8, 3, 1), (h, inter): (64, 128, 4, 3, 4)}  # fmt: skip
        monkeypatch.setattr(gemv, "DOT_LAUNCHES", launches)
        monkeypatch.setattr(gemv, "DOT_DTYPES", (torch.float32,))  # this test's dtype

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[(31 * j + 5) % 4000 + 1 for j in range(300)], [9, 8, 7, 6, 5]]
    results = []
    for backend, enforce_eager in (("torch", True), ("triton", False)):
        core = _core(
            tmp_path,
            max_model_len=1024,
            max_num_seqs=1,
            attention_backend=backend,
            enforce_eager=enforce_eager,
        )  # one sequence: the start-up warm-up must fit that too
        assert core.runner.model.gemv_rows == (1 if backend == "triton" else 0)
        if backend == "triton":
            assert core.runner.model.layers[0].gemv_mlp == whole_layers
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):  # one at a time
            core.add_request(f"g{i}", prompt, params)
            tokens |= _drain(core)
        if backend == "triton":
            graphs = core.runner.graphs
            assert graphs is not None and graphs.num_steps.get(1, 0) >= 70
        results.append(tokens)
        del core
        _release_memory()
    assert results[1] == results[0] and all(len(t) == 40 for t in results[0].values())


def _defaults_and_a_lone_request_match_reference(model_dir: Path) -> Any:
    """The 19 requests of ``_run`` on the GPU's defaults give the eager reference's greedy
    tokens, through decode graphs and prompt pieces; then a lone request's decode steps (the
    size-1 graph, its layers' attention projections as GEMVs) give the reference's too.
    Returns the GPU's engine's model."""
    from baton_engine.sampling_params import SamplingParams

    want = _run(model_dir, "torch", enforce_eager=True, async_scheduling=False)[0]
    _release_memory()
    got, core = _run(model_dir, "triton", enforce_eager=False)
    assert got == want
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(24, 0) > 0
    assert core.runner.pieces is not None and core.runner.pieces.replays[False] > 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    core.add_request("lone", [(7 * j) % 4000 + 1 for j in range(50)], params)
    lone = _drain(core)["lone"]  # decode steps of one request: the size-1 graph
    assert graphs.num_steps.get(1, 0) >= 20
    assert core.runner.model.gemv_rows == 1
    model = core.runner.model
    del core
    _release_memory()
    ref = _core(model_dir, max_model_len=1024, max_num_seqs=24, attention_backend="torch",
                enforce_eager=True, async_scheduling=False)  # fmt: skip
    ref.add_request("lone", [(7 * j) % 4000 + 1 for j in range(50)], params)
    assert _drain(ref)["lone"] == lone
    return model


def test_a_mixture_of_experts_on_the_gpus_defaults_matches_reference(tmp_path: Path) -> None:
    """A Qwen3-MoE shape (16 experts, 2 a token) on the GPU's defaults: its decode steps are
    captured in CUDA graphs and its prompt steps in pieces, the experts the Triton grouped
    GEMMs (``baton_kernels.triton.moe``), a lone request's attention projections GEMVs, and
    they give the eager reference's greedy tokens (the torch backend: the experts one by one
    as routed)."""
    moe = CONFIG | {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "norm_topk_prob": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(moe))
    model = _defaults_and_a_lone_request_match_reference(tmp_path)
    assert not model.folded_norms  # (plain layers only)


def test_qwen3_on_the_gpus_defaults_matches_reference(tmp_path: Path) -> None:
    """Qwen3's q/k norms (one in-place Triton launch, ``fused_ops.head_rms_norm_``) on the
    GPU's defaults, in decode graphs, prompt pieces and a lone request's GEMV layers: the
    eager reference's greedy tokens (torch's ``F.rms_norm`` per head)."""
    qwen3 = CONFIG | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                      "head_dim": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(qwen3))
    model = _defaults_and_a_lone_request_match_reference(tmp_path)
    assert model.config.qk_norm and not model.folded_norms


def test_granite_on_the_gpus_defaults_matches_reference(tmp_path: Path) -> None:
    """Granite's multipliers (embeddings, attention scale, logits) on the GPU's defaults: CUDA
    graphs, piecewise prompt graphs, folded norms and the fused GEMV layers give the eager
    reference's greedy tokens."""
    granite = CONFIG | {
        "architectures": ["GraniteForCausalLM"],
        "model_type": "granite",
        "embedding_multiplier": 12.0,
        "residual_multiplier": 0.22,
        "attention_multiplier": 0.015625,
        "logits_scaling": 8.0,
    }
    (tmp_path / "config.json").write_text(json.dumps(granite))
    want = _run(tmp_path, "torch", enforce_eager=True, async_scheduling=False)[0]
    _release_memory()
    got, core = _run(tmp_path, "triton", enforce_eager=False)
    assert got == want
    assert core.runner.model.folded_norms and core.runner.pieces is not None


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral"])
def test_sliding_windows_on_the_gpus_defaults_match_reference(arch: str, tmp_path: Path) -> None:
    """Local layers attending to their last 100 tokens (the prompts reach ~700) on the GPU's
    defaults: Gemma 2 (heads of 256, capped scores and logits, GeGLU, sandwich norms), Gemma 3
    (q/k norms, the local layers' own rope) and a Mistral-7B-v0.1 kind (every layer local,
    through the folded norms and the fused GEMV layers of a lone request) give the eager
    reference's greedy tokens: the Triton kernels' windows and softcaps in CUDA graphs and
    prompt chunks."""
    from baton_engine.sampling_params import SamplingParams

    config = CONFIG | {"sliding_window": 100}
    if arch == "mistral":
        config |= {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    else:
        config |= {
            "architectures": ["Gemma2ForCausalLM" if arch == "gemma2" else "Gemma3ForCausalLM"],
            "model_type": "gemma2" if arch == "gemma2" else "gemma3_text",
            "num_attention_heads": 4,
            "head_dim": 256 if arch == "gemma2" else 128,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 144,
            "attn_logit_softcapping": 50.0 if arch == "gemma2" else None,
            "final_logit_softcapping": 30.0 if arch == "gemma2" else None,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "rope_local_base_freq": 10000.0,
        }
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = _run(tmp_path, "torch", enforce_eager=True, async_scheduling=False)[0]
    _release_memory()
    got, core = _run(tmp_path, "triton", enforce_eager=False)
    assert got == want
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(24, 0) > 0
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = [(7 * j) % 4000 + 1 for j in range(300)]
    core.add_request("lone", prompt, params)
    lone = _drain(core)["lone"]
    if arch == "mistral":
        assert core.runner.model.folded_norms and core.runner.model.gemv_rows > 0
    del core
    _release_memory()
    ref = _core(tmp_path, max_model_len=1024, max_num_seqs=24, attention_backend="torch",
                enforce_eager=True, async_scheduling=False)  # fmt: skip
    ref.add_request("lone", prompt, params)
    assert _drain(ref)["lone"] == lone


def test_a_second_engine_over_the_share_names_the_first(tmp_path: Path) -> None:
    """Two engines in one process (a notebook's second ``LLM``) whose shares exceed the GPU:
    the second's refusal says this process holds the first's memory, and how to free it."""
    from baton_engine.errors import InvalidRequestError

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    first = _core(tmp_path, max_model_len=512, gpu_memory_utilization=0.6)
    with pytest.raises(InvalidRequestError, match="by this process, an earlier engine"):
        _core(tmp_path, max_model_len=512, gpu_memory_utilization=0.6)
    del first
    _release_memory()
    _core(tmp_path, max_model_len=512, gpu_memory_utilization=0.6)  # (room again)


def test_multi_step_equals_single_step(tmp_path: Path) -> None:
    """Multi-step scheduling on the GPU's defaults (decode graphs, async scheduling): several
    passes a step, each pass's input the pass before's token on the device, give the tokens of
    one pass a step, for greedy and seeded random sampling, with requests ending at different
    steps (the batch shrinks between and inside multi-steps)."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=37, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=1, max_tokens=29, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=6),  # EOS may end it
        # greedy through the sampler: logits reshaped on the device in every pass
        SamplingParams(
            temperature=0.0, max_tokens=33, ignore_eos=True, logit_bias={7: 3.0, 11: -2.0}
        ),
        SamplingParams(
            temperature=0.8, seed=4, max_tokens=31, ignore_eos=True, allowed_token_ids=[5, 9, 13]
        ),
    ]
    results, multi = [], []
    for steps in (1, 4):
        core = _core(tmp_path, max_model_len=512, max_num_seqs=16, num_scheduler_steps=steps)
        for i in range(12):
            prompt = [(13 * i + j) % 4000 + 1 for j in range(5 + 7 * i)]
            core.add_request(f"m{i}", prompt, kinds[i % len(kinds)])
        results.append(_drain(core))
        multi.append(core.scheduler.num_multi_steps)
        del core
        _release_memory()
    assert results[1] == results[0]
    assert multi[0] == 0 and multi[1] > 0
    allowed = [t for i in range(12) if i % len(kinds) == 4 for t in results[0][f"m{i}"]]
    assert allowed and set(allowed) <= {5, 9, 13}


def test_speculative_decoding_gives_the_greedy_tokens(tmp_path: Path) -> None:
    """n-gram drafts on the GPU's defaults (a step's decodes and drafts replay the decode
    graphs, a row a token), and with async scheduling (drafts after a pending token, taken on
    the device): the greedy tokens of a run without drafts, for prompts that repeat
    themselves (drafts are proposed), and a seeded sampled request's tokens (each drawn with
    the seed of its index, drafted or not)."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    results, drafts, wide = [], [], 0
    for config, asynchronous in ((None, None), (spec, None), (spec, True)):
        core = _core(tmp_path, max_model_len=512, max_num_seqs=16, speculative_config=config,
                     async_scheduling=asynchronous)  # fmt: skip
        for i in range(10):
            prompt = [(11 * i + j) % 4000 + 1 for j in range(6 + i)] * 4
            core.add_request(f"s{i}", prompt, seeded if i == 9 else greedy)
        results.append(_drain(core))
        drafts.append(core.scheduler.num_draft_tokens)
        steps = core.runner.graphs.num_steps
        wide = sum(n for size, n in steps.items() if size > 16)  # more rows than requests
        del core
        _release_memory()
    assert results[2] == results[1] == results[0]
    assert drafts[0] == 0 and drafts[1] > 0 and drafts[2] > 0 and wide > 0


def test_the_host_kv_tier_under_the_gpus_defaults(tmp_path: Path) -> None:
    """--kv-offloading-size with CUDA graphs and async scheduling: a third wave of requests
    comes back to the first wave's contexts, which the second wave evicted from a small pool,
    while earlier requests still decode. Their prefixes, copied back from pinned host memory
    on the stream, give the tokens of a pool that kept them."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(1)
    contexts = [torch.randint(1, 4000, (300,), generator=g).tolist() for _ in range(16)]
    waves = [
        [(f"a{i}", contexts[i] + [11, 12]) for i in range(8)],
        [(f"b{i}", contexts[8 + i] + [11, 12]) for i in range(8)],
        [(f"c{i}", contexts[i] + [21, 22, 23]) for i in range(8)],
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results, hits = [], []
    for blocks, tier in ((1200, None), (200, 0.05)):
        core = _core(
            tmp_path, max_model_len=512, max_num_seqs=16, num_gpu_blocks_override=blocks,
            kv_offloading_size=tier,
        )  # fmt: skip
        tokens: dict[str, list[int]] = {}
        for wave in waves:
            for n, (req_id, prompt) in enumerate(wave):
                core.add_request(req_id, prompt, params)
                if n % 3 == 2:  # a few steps between arrivals: loads among decodes
                    for _ in range(2):
                        for out in core.step():
                            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            for req_id, more in _drain(core).items():
                tokens.setdefault(req_id, []).extend(more)
        results.append(tokens)
        hits.append((core.kv.num_prefix_hits, core.kv.num_host_hits))
        del core
        _release_memory()
    assert hits[0][1] == 0 and hits[1][1] >= 8 * 288 // 2  # most of wave c's from the tier
    assert results[1] == results[0]


def test_a_draft_model_gives_the_greedy_tokens(tmp_path: Path) -> None:
    """A draft model on the GPU's defaults (the target's steps of drafts from the decode
    graphs, the draft's decode passes from its own): the model as its own draft and a 2-layer
    early exit of it (its dummy weights are the model's first layers': drawn in order from
    the same seed) give the greedy tokens of a run without drafts, and a seeded sampled
    request its tokens; the model as its own draft keeps nearly all its drafts."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "exit").mkdir()
    (tmp_path / "exit" / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": 2}))
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 4000, (8 + 29 * i,), generator=g).tolist() for i in range(10)]
    results, kept, replays = [], [], []
    for draft in (None, "model", "exit"):
        spec = {"model": str(tmp_path / draft), "num_speculative_tokens": 3} if draft else None
        core = _core(tmp_path / "model", max_model_len=512, max_num_seqs=16,
                     speculative_config=spec)  # fmt: skip
        for i, prompt in enumerate(prompts):
            core.add_request(f"s{i}", prompt, seeded if i == 9 else greedy)
        results.append(_drain(core))
        sched = core.scheduler
        kept.append(sched.num_accepted_tokens / max(1, sched.num_draft_tokens))
        if draft:
            replays.append(sum(core.runner.draft.runner.graphs.replays.values()))
        del core
        _release_memory()
    assert results[1] == results[0] and results[2] == results[0]
    assert kept[1] > 0.8, kept
    assert min(replays) > 0


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_the_memory_back_and_waking_the_tokens(level: int, tmp_path: Path) -> None:
    """Sleep mode on the GPU's defaults (CUDA graphs, norms folded into the projections), with
    the model as its own draft: asleep, the engine holds under 5% of the device memory it held
    (weights, KV pool, graphs), and refuses requests; woken (the weights first, then the KV
    cache), it gives the tokens it gave before, from graphs captured again (the draft's too),
    its drafts still kept. Level 2 reads the weights again (the dummy draw) and folds the
    norms again. Sleeping with requests kept (vLLM's mode "keep": paused with keep first), they
    end with the same tokens after waking."""
    from baton_engine.errors import EngineSleepingError
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    spec = {"model": str(tmp_path), "num_speculative_tokens": 3}
    core = _core(tmp_path, max_model_len=512, max_num_seqs=16, speculative_config=spec,
                 enable_sleep_mode=True)  # fmt: skip
    assert core.runner.model.folded_norms
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, 4000, (8 + 29 * i,), generator=g).tolist() for i in range(8)]

    def run(core: Any, tag: str) -> dict[str, list[int]]:
        for i, prompt in enumerate(prompts):
            core.add_request(f"{tag}{i}", prompt, greedy)
        return {k[len(tag) :]: v for k, v in _drain(core).items()}

    before = run(core, "a")
    held = torch.cuda.memory_allocated()
    core.sleep(level)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < held / 20, (torch.cuda.memory_allocated(), held)
    with pytest.raises(EngineSleepingError):
        core.add_request("z", prompts[0], greedy)
    core.wake_up(["weights"])
    assert core.is_sleeping()
    core.wake_up(["kv_cache"])
    assert not core.is_sleeping()
    drafts = core.scheduler.num_draft_tokens, core.scheduler.num_accepted_tokens
    assert run(core, "b") == before
    kept = (core.scheduler.num_accepted_tokens - drafts[1]) / (
        core.scheduler.num_draft_tokens - drafts[0]
    )
    assert kept > 0.8, kept
    assert sum(core.runner.graphs.replays.values()) > 0
    assert sum(core.runner.draft.runner.graphs.replays.values()) > 0
    for i, prompt in enumerate(prompts):
        core.add_request(f"c{i}", prompt, greedy)
    tokens: dict[str, list[int]] = {}
    for n in range(100):
        if n == 6:
            core.pause(keep=True)
        if n >= 6 and not core.has_schedulable_requests():
            break
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    assert 0 < sum(map(len, tokens.values())) < 8 * 40
    core.sleep(level, keep=True)
    assert torch.cuda.memory_allocated() < held / 20
    core.wake_up()
    for req_id, more in _drain(core).items():
        tokens.setdefault(req_id, []).extend(more)
    assert {k[1:]: v for k, v in tokens.items()} == before
    del core
    _release_memory()


def test_the_profiler_records_the_gpus_kernels(tmp_path: Path) -> None:
    """``profiler_config`` on the GPU: the torch profiler's trace holds the steps' CUDA
    kernels (CUDA graphs replayed inside them) and the table sorts by their own CUDA time;
    the "cuda" profiler (cudaProfilerStart / Stop, for Nsight Systems) starts and stops."""
    import gzip

    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    traces = tmp_path / "traces"
    profiler = {
        "profiler": "torch",
        "torch_profiler_dir": str(traces),
        "torch_profiler_with_stack": False,  # (torch's table parse fails at times with stacks)
    }
    core = _core(tmp_path, max_model_len=256, max_num_seqs=8, profiler_config=profiler)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    core.start_profile("gpu")
    for i in range(4):
        core.add_request(f"r{i}", list(range(10 + i, 40 + i)), greedy)
    _drain(core)
    core.stop_profile()
    (trace,) = traces.glob("gpu-rank0-*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    assert sum(e.get("cat") == "kernel" for e in events) > 16
    assert sum(e.get("name") == "engine_step" for e in events) >= 16
    assert "CUDA" in (traces / "profiler_out_0.txt").read_text()
    del core
    _release_memory()
    core = _core(tmp_path, max_model_len=256, max_num_seqs=8, profiler_config={"profiler": "cuda"})
    core.start_profile()
    core.add_request("c", list(range(10, 40)), greedy)
    assert len(_drain(core)["c"]) == 16
    core.stop_profile()
    del core
    _release_memory()


def test_prompt_embeddings_on_the_gpus_defaults(tmp_path: Path) -> None:
    """Prompts given as their tokens' embeddings on the GPU's defaults (Triton, decode graphs,
    piecewise prompt graphs, async scheduling; a step with embeddings runs eagerly): the
    tokens' outputs, also for prompts of one and two rows added while the others decode (a
    step of one token a request, which would otherwise replay a decode graph)."""
    from baton_engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    core = _core(
        tmp_path, max_model_len=1024, max_num_seqs=24, max_num_batched_tokens=64,
        enable_prompt_embeds=True, enable_prefix_caching=False,
    )  # fmt: skip
    table = core.runner.model.embed_tokens.weight.detach().float().cpu()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 4000, (n,), generator=g).tolist() for n in (9, 40, 100, 7, 33)]
    late = [[17], [23, 99]]

    def run(tag: str, embeds: bool) -> dict[str, list[int]]:
        def add(i: int, prompt: list[int]) -> None:
            if embeds and i % 2 == 0:
                core.add_request(f"{tag}{i}", [], params, prompt_embeds=table[prompt])
            else:
                core.add_request(f"{tag}{i}", prompt, params)

        for i, prompt in enumerate(prompts):
            add(i, prompt)
        tokens: dict[str, list[int]] = {}
        for _ in range(6):  # (every prompt computed: decodes)
            for out in core.step():
                tokens.setdefault(out.req_id[1:], []).extend(out.new_token_ids)
        for i, prompt in enumerate(late):
            add(len(prompts) + 1 + 2 * i, prompt)  # (even: embeddings)
        for req_id, more in _drain(core).items():
            tokens.setdefault(req_id[1:], []).extend(more)
        return tokens

    want = run("t", embeds=False)
    assert core.runner.graphs is not None and core.runner.graphs.num_steps
    assert run("e", embeds=True) == want
    assert all(len(t) == 24 for t in want.values()) and len(want) == 7

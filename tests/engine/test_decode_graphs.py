"""Decode steps through the persistent, padded buffers that CUDA graphs replay: on CPU the same
path runs eagerly with the Triton kernels under the interpreter, and its greedy tokens equal the
reference backend's on the same (dummy-weight, float32) model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

pytest.importorskip("triton")

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.runner.cuda_graphs import PieceGraphs
from baton_engine.sampling_params import SamplingParams

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}
# (8 experts of 32, 2 a token, q/k norms)
TINY_QWEN3_MOE = TINY_LLAMA | {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
}


def make_core(
    model_dir: Path,
    backend: str,
    async_scheduling: bool,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int | None = None,
    num_scheduler_steps: int = 1,
    speculative_config: dict[str, object] | None = None,
    enable_sleep_mode: bool = False,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            load_format="dummy",
            dtype="float32",
            max_model_len=128,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_gpu_blocks_override=64,
            attention_backend=backend,
            async_scheduling=async_scheduling,
            num_scheduler_steps=num_scheduler_steps,
            speculative_config=speculative_config,
            enable_sleep_mode=enable_sleep_mode,
        )
    )


def randomize_norms(core: EngineCore) -> None:
    """Norm weights drawn from a fixed seed in place of the dummy weights' ones (so that folding
    them into the projections changes the weights)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in core.runner.model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn(param.shape, generator=gen))


def run(
    model_dir: Path,
    backend: str,
    graphs: bool,
    async_scheduling: bool = False,
    fused: bool = False,
    pieces: bool = False,
    max_num_batched_tokens: int | None = None,
    random_norms: bool = False,
    fold: bool = False,
    fold_prompts: bool = False,
    num_scheduler_steps: int = 1,
    weight_scale: float = 1.0,
    num_speculative_tokens: int = 0,
    triton_experts: bool = False,
) -> tuple[dict[str, list[int]], EngineCore]:
    spec = {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": 1}  # fmt: skip
    core = make_core(
        model_dir,
        backend,
        async_scheduling,
        max_num_batched_tokens=max_num_batched_tokens,
        num_scheduler_steps=num_scheduler_steps,
        speculative_config=spec if num_speculative_tokens else None,
    )
    if weight_scale != 1.0:  # (larger scores and logits than the dummy weights give)
        with torch.no_grad():
            for name, param in core.runner.model.named_parameters():
                if "norm" not in name:
                    param.mul_(weight_scale)
    if random_norms:
        randomize_norms(core)
    if fused:
        core.runner.model.use_fused_kernels()
    if triton_experts:
        assert core.runner.model.use_triton_experts()
    if fold:
        assert core.runner.model.fold_norms(prompts=fold_prompts)
    if graphs:
        assert core.runner.enable_decode_graphs(False, num_speculative_tokens)
        assert core.runner.graphs is not None and core.runner.graphs.sizes[:3] == [1, 2, 4]
    if pieces:
        core.runner.enable_piece_graphs(capture=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + 9 * i)] for i in range(5)]
    return drain(core, prompts, params), core  # (5 decodes: padded to the captured size 8)


def drain(
    core: EngineCore, prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Add ``prompts`` as ``r0``, ``r1``, ... and step until all are done: each one's tokens;
    the engine's invariants checked."""
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
    core.check_invariants()
    return tokens


def test_padded_decode_path_matches_reference(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, _ = run(tmp_path, "torch", graphs=False)
    got, core = run(tmp_path, "triton", graphs=True)
    assert got == want
    assert all(len(t) == 10 for t in got.values())
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(8, 0) >= 8  # 5 requests padded to 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_drafts_through_the_decode_graphs_match_reference(
    tmp_path: Path, async_scheduling: bool
) -> None:
    """Speculative decoding on the GPU's decode path: a step of decodes and n-gram drafts runs
    every token as a row of the padded graph buffers (captured up to 8 requests times 4 rows),
    each draft's row attending to the K/V its step wrote before it; with async scheduling, a
    request's first row takes its pending token from the step before's samples on the device.
    The greedy tokens equal the reference's without drafts."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, _ = run(tmp_path, "torch", graphs=False)
    got, core = run(tmp_path, "triton", graphs=True, async_scheduling=async_scheduling,
                    num_speculative_tokens=3)  # fmt: skip
    assert got == want
    graphs = core.runner.graphs
    assert graphs is not None and graphs.max_batch_size == 32
    assert core.scheduler.num_accepted_tokens > 0  # (drafts held: fewer steps than tokens)
    assert sum(n for size, n in graphs.num_steps.items() if size > 8) > 0  # rows of drafts
    assert (core.scheduler.num_guessed_drafts > 0) == async_scheduling


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_windows_and_softcaps_through_the_decode_path_match_reference(
    arch: str, tmp_path: Path
) -> None:
    """Layers that attend to their last 8 tokens (Gemma 2's local ones, with its capped scores
    and logits; every layer of a Mistral-7B-v0.1 kind, its norms folded into the projections):
    the Triton kernels' windows and softcaps through the padded decode buffers and piecewise
    prompt steps give the reference's tokens."""
    config = TINY_LLAMA | {"sliding_window": 8}
    if arch == "gemma2":
        config |= {
            "architectures": ["Gemma2ForCausalLM"],
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "layer_types": ["sliding_attention", "full_attention"],
        }
    (tmp_path / "config.json").write_text(json.dumps(config))
    options = dict(random_norms=True, weight_scale=10.0)
    want, _ = run(tmp_path, "torch", graphs=False, **options)  # type: ignore[arg-type]
    got, core = run(tmp_path, "triton", graphs=True, fused=True, pieces=True,
                    fold=arch == "mistral", **options)  # type: ignore[arg-type]  # fmt: skip
    assert got == want
    assert core.runner.graphs is not None and sum(core.runner.graphs.num_steps.values()) > 0
    windows = [layer.self_attn.window for layer in core.runner.model.layers]
    assert windows == ([8, 0] if arch == "gemma2" else [8, 8])


def test_padded_decode_path_with_async_scheduling(tmp_path: Path) -> None:
    """The GPU's configuration: graph steps launched before the previous step's tokens reach
    the host, their input ids filled on the device from that step's samples; the fused Triton
    norm, rotary and SiLU kernels in every step."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, _ = run(tmp_path, "torch", graphs=False)
    got, core = run(tmp_path, "triton", graphs=True, async_scheduling=True, fused=True)
    assert got == want
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(8, 0) >= 8


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multi_step_passes_through_the_decode_graphs_match_reference(
    tmp_path: Path, async_scheduling: bool
) -> None:
    """Multi-step scheduling on the GPU's decode path: three passes a step through the padded
    buffers, the first copying the block tables for all three, each later one taking its input
    ids from the pass before on the device and reusing its gathering."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, _ = run(tmp_path, "torch", graphs=False)
    got, core = run(
        tmp_path, "triton", graphs=True, async_scheduling=async_scheduling, num_scheduler_steps=3
    )
    assert got == want
    assert core.scheduler.num_multi_steps == 3  # tokens 2-10 of each (the first: the prompt's)
    assert core.runner.num_steady_launches >= 6  # the later passes at least
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(8, 0) == 9


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_decode_steps_with_folded_norms_match_reference(tmp_path: Path, qkv_bias: bool) -> None:
    """What a GPU runs for decode steps of several requests (``fold_norms``): the norms'
    weights folded into the projections after them, each layer without its norm kernels (the
    decode kernel and SiLU-and-multiply apply the 1/rms; o_proj and down_proj add into the
    residual stream), through the padded graph buffers. The prompt steps run the ordinary
    layers on the folded weights. Greedy tokens equal the reference backend's on the unfolded
    model, whose norms' weights are random."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "attention_bias": qkv_bias}))
    want, _ = run(tmp_path, "torch", graphs=False, random_norms=True)
    got, core = run(
        tmp_path, "triton", graphs=True, async_scheduling=True, fused=True, random_norms=True,
        fold=True,
    )  # fmt: skip
    assert got == want
    model = core.runner.model
    assert model.folded_norms and model.layers[0].input_layernorm.weight.eq(1).all()
    graphs = core.runner.graphs
    assert graphs is not None and graphs.num_steps.get(8, 0) >= 8


@pytest.mark.parametrize("pieces", [False, True])
def test_prompt_steps_with_folded_norms_match_reference(tmp_path: Path, pieces: bool) -> None:
    """What a GPU runs for every step (``fold_norms(prompts=True)``): the prompt chunks and the
    mixed steps' layers folded too, without norm kernels (the rotary kernel applies the input
    norm and the qkv bias, SiLU-and-multiply the second norm), eagerly or through the padded
    piece buffers; a 32-token budget chunks the prompts and mixes them with decodes. Greedy
    tokens equal the reference backend's on the unfolded model with random norm weights."""
    (tmp_path / "config.json").write_text(json.dumps({**TINY_LLAMA, "attention_bias": True}))
    want, _ = run(tmp_path, "torch", graphs=False, random_norms=True, max_num_batched_tokens=32)
    got, core = run(
        tmp_path, "triton", graphs=True, async_scheduling=True, fused=True, random_norms=True,
        fold=True, fold_prompts=True, pieces=pieces, max_num_batched_tokens=32,
    )  # fmt: skip
    assert got == want
    model = core.runner.model
    assert model.folded_prompts and model.layers[0].post_attention_layernorm.weight.eq(1).all()
    if pieces:
        assert core.runner.pieces is not None and core.runner.pieces.num_steps.get(32, 0) >= 4


def run_pieces_against_reference(tmp_path: Path, fused: bool) -> PieceGraphs:
    """The engine with ``PieceGraphs`` (eager, padded) and a 32-token budget, whose greedy
    tokens must equal the reference backend's, eager and unpadded: its pieces."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, _ = run(tmp_path, "torch", graphs=False, max_num_batched_tokens=32)
    got, core = run(
        tmp_path, "triton", graphs=True, async_scheduling=True, fused=fused, pieces=True,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert got == want
    assert core.runner.pieces is not None
    return core.runner.pieces


@pytest.mark.parametrize("fused", [False, True])
def test_prompt_steps_run_piecewise_through_padded_buffers(tmp_path: Path, fused: bool) -> None:
    """What a GPU runs for every step that is not decode-only (``PieceGraphs``): the layers
    between two attentions from static buffers padded to a captured token count, attention
    eagerly on the real rows. With a 32-token budget the prompts are chunked and mixed with
    decodes. With the torch ops (``fused=False``) the residual stream is a new tensor in each
    piece and is copied back; the fused norm updates it in place."""
    pieces = run_pieces_against_reference(tmp_path, fused)
    assert pieces.sizes == [16, 32]
    # 105 prompt tokens and the decodes mixed in: three full steps, the last (18 tokens)
    # padded to 32
    assert pieces.num_steps.get(32, 0) >= 4


def test_a_mixture_of_experts_runs_the_triton_experts_in_graphs_and_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a GPU runs for a mixture of experts: decode steps through the padded graph buffers,
    every other step through ``PieceGraphs`` (padding rows routed too), the experts as Triton's
    grouped GEMMs (``use_triton_experts``; under the interpreter here). Its greedy tokens equal
    the reference backend's, whose experts run one by one as routed."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_QWEN3_MOE))
    from baton_kernels.triton import moe as kernels

    calls: list[int] = []
    fused_experts = kernels.fused_experts
    monkeypatch.setattr(kernels, "fused_experts",
                        lambda x, *a: calls.append(x.shape[0]) or fused_experts(x, *a))  # fmt: skip
    want, _ = run(tmp_path, "torch", graphs=False, max_num_batched_tokens=32)
    assert not calls
    got, core = run(
        tmp_path, "triton", graphs=True, fused=True, pieces=True, triton_experts=True,
        max_num_batched_tokens=32,
    )  # fmt: skip
    assert got == want
    pieces, graphs = core.runner.pieces, core.runner.graphs
    assert pieces is not None and pieces.num_steps.get(32, 0) >= 4
    assert graphs is not None and graphs.num_steps.get(8, 0) >= 4
    # every layer of every step: padded prompt steps (32 rows) and decode steps (8)
    assert {32, 8} <= set(calls)


def test_steps_beyond_the_largest_piece_size_run_eagerly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pieces are captured up to ``PIECE_MAX_TOKENS``; a step of more tokens runs the model's
    eager forward. Here every step with prompt tokens has more than 16."""
    from baton_engine.runner import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "PIECE_MAX_TOKENS", 16)
    pieces = run_pieces_against_reference(tmp_path, fused=True)
    assert pieces.sizes == [16]
    assert sum(pieces.num_steps.values()) == 0


@pytest.mark.parametrize(
    ("gemv_mlp", "fold", "down", "dot"),
    [
        (True, False, False, False),
        (False, False, False, False),
        (False, True, False, False),
        (False, True, True, False),
        (False, True, True, True),
    ],
)
def test_one_request_decode_runs_the_fused_gemv_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gemv_mlp: bool, fold: bool, down: bool,
    dot: bool,
) -> None:  # fmt: skip
    """What a GPU runs for a lone request (``use_gemv_decode``): each layer as Triton GEMVs
    with the norms, SiLU and residual adds inside (a small model), or the attention's
    projections only, the MLP through torch with its residual add in the GEMM (a large one;
    with the norms folded, ``fold``, SiLU-and-multiply applies the second norm; with ``down``,
    the down projection as a GEMV that applies it and SiLU-and-multiply itself), through the
    padded graph buffers of size 1; with ``dot``, every projection on the tensor-core GEMV,
    gate_up too, some split over K). Its greedy tokens equal the reference backend's (with
    random norm weights when folded)."""
    from baton_kernels.triton import gemv

    # The interpreter runs a launch's programs one after another: 32 columns a program rather
    # than choose_launch's 2 for weights this small (launches at real shapes: test_triton_gemv)
    monkeypatch.setattr(gemv, "choose_launch", lambda n, k: ((32, 2048, 4, 2), 0))
    if dot:
        from baton_kernels.triton import common

        h, inter = TINY_LLAMA["hidden_size"], TINY_LLAMA["intermediate_size"]
        launches = {(2 * h, h): (64, 32, 4, 2, 2), (h, h): (64, 64, 4, 2, 1),
                    (2 * inter, h): (128, 32, 4, 2, 1), (h, inter): (64, 32, 4, 2, 3)}  # fmt: skip
        monkeypatch.setattr(gemv, "DOT_LAUNCHES", launches)
        monkeypatch.setattr(gemv, "DOT_DTYPES", (torch.float32,))  # the tiny model's
        monkeypatch.setattr(common, "_COUNTERS", {})
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    # (8 tokens: 14 decode steps through the interpreted kernels)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {"a": [5, 17, 33, 2, 91, 40, 7], "b": [200, 3, 3, 150]}
    tokens: dict[str, dict[str, list[int]]] = {}
    for backend in ("torch", "triton"):
        core = make_core(tmp_path, backend, async_scheduling=backend == "triton", max_num_seqs=4)
        if fold:
            randomize_norms(core)
        if backend == "triton":
            core.runner.model.use_fused_kernels()
            assert core.runner.model.use_gemv_decode(rows=1, mlp=gemv_mlp, down=down)
            assert not fold or core.runner.model.fold_norms()
            assert core.runner.enable_decode_graphs(capture=False)
        got = tokens[backend] = {}
        for req_id, prompt in prompts.items():  # one at a time: every decode step has one row
            core.add_request(req_id, prompt, params)
            while core.has_unfinished_requests():
                for out in core.step():
                    got.setdefault(out.req_id, []).extend(out.new_token_ids)
        if backend == "triton":
            graphs = core.runner.graphs
            assert graphs is not None and graphs.num_steps.get(1, 0) >= 14
            if dot:  # the split launches ran (their counters exist, back at zero)
                from baton_kernels.triton import common

                counters = [c for (_, owner), c in common._COUNTERS.items() if owner == "gemv"]
                assert counters and not counters[0].any()
        core.check_invariants()
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 8 for t in tokens["torch"].values())


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_a_lone_request_with_qk_norms_runs_the_gemv_layers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A Qwen3(-MoE) decode step of one request on a GPU's path (``use_gemv_decode``): the
    attention's projections as GEMVs (the first norm inside qkv, the residual add inside o),
    the q/k norms, then the MLP as GEMVs, or the second norm, the router as a GEMV and the
    Triton experts, whose sum's kernel adds them to the stream. Its greedy tokens equal the
    reference backend's."""
    from baton_engine.models.llama import DecoderLayer
    from baton_kernels.triton import gemv, moe

    monkeypatch.setattr(gemv, "choose_launch", lambda n, k: ((32, 2048, 4, 2), 0))
    added: list[int] = []  # the experts' sums added to the stream in their kernel
    sum_pairs = moe.sum_pairs
    monkeypatch.setattr(moe, "sum_pairs", lambda x, residual=None, out=None: (
        added.append(x.shape[0]) if residual is not None else None) or sum_pairs(
        x, residual, out))  # fmt: skip
    qwen3 = TINY_LLAMA | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    config = TINY_QWEN3_MOE if arch == "qwen3_moe" else qwen3
    (tmp_path / "config.json").write_text(json.dumps(config))
    layers: list[int] = []
    forward_gemv = DecoderLayer.forward_gemv
    monkeypatch.setattr(DecoderLayer, "forward_gemv",
                        lambda self, *a: layers.append(1) or forward_gemv(self, *a))  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for backend in ("torch", "triton"):
        core = make_core(tmp_path, backend, async_scheduling=False, max_num_seqs=4)
        if backend == "triton":
            model = core.runner.model
            model.use_fused_kernels()
            assert model.use_triton_experts() == (arch == "qwen3_moe")
            assert model.use_gemv_decode(rows=1)
            assert core.runner.enable_decode_graphs(capture=False)
        core.add_request("lone", [5, 17, 33, 2, 91, 40, 7], params)
        got = tokens[backend] = []
        while core.has_unfinished_requests():
            for out in core.step():
                got.extend(out.new_token_ids)
        core.check_invariants()
    assert tokens["triton"] == tokens["torch"] and len(tokens["torch"]) == 6
    # 5 decode steps of every layer
    assert len(layers) == 5 * TINY_LLAMA["num_hidden_layers"]
    assert added == ([1] * len(layers) if arch == "qwen3_moe" else [])


def _staggered_run(
    model_dir: Path, reuse: bool, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[str, list[int]], int, int]:
    from baton_engine.runner import model_runner

    monkeypatch.setattr(model_runner, "REUSE_GATHER", reuse)
    core = make_core(model_dir, "triton", async_scheduling=True)
    assert core.runner.enable_decode_graphs(capture=False)
    tokens: dict[str, list[int]] = {}

    def add(i: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(f"r{i}", [(5 * i + j) % 250 + 1 for j in range(4 + 3 * i)], params)

    for i, n in enumerate((16, 8, 40, 12)):
        add(i, n)
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 5:
            add(4, 6)  # joins the running batch
        if steps == 14:
            core.abort_requests(["r2"])  # leaves it, r0 still running
    core.check_invariants()
    graphs = core.runner.graphs
    assert graphs is not None
    return tokens, core.runner.num_steady_launches, sum(graphs.num_steps.values())


def test_steady_decode_reuses_the_last_launch_and_samples_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step of the same requests in the same order as the step just launched, or of
    those less some that left, reuses its rows and positions (``model_runner.REUSE_GATHER``):
    with requests finishing at different steps, one joining and one aborted mid-way, every
    request's tokens equal those of a run that reads every request's state each step, and
    every decode step but two did reuse."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    want, none, _ = _staggered_run(tmp_path, False, monkeypatch)
    got, reused, graph_steps = _staggered_run(tmp_path, True, monkeypatch)
    assert got == want
    # every graph step but the first and the one a new request joins: those that lost
    # requests reuse the rest (_DecodeGather.fewer)
    assert none == 0 and reused >= graph_steps - 2
    assert [len(want[f"r{i}"]) for i in (0, 1, 3, 4)] == [16, 8, 12, 6]
    assert 0 < len(want["r2"]) < 40


@pytest.mark.parametrize("draft_layers", [2, 1])
def test_a_draft_models_passes_through_its_graphs_match_reference(
    tmp_path: Path, draft_layers: int
) -> None:
    """A draft model on the GPU's paths: the target checks the drafts through its decode
    graphs, the draft's first pass runs through its piecewise buffers (prompts) or its decode
    graphs a row a token (a request's kept drafts and the token after them), its decode passes
    through its decode graphs (a request dropping out of them at the last positions of
    the context, the others' block tables then copied again). The model as its own draft (the
    same dummy weights) keeps its drafts; a one-layer draft (other weights) keeps few; the
    greedy tokens equal the reference's."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(
        json.dumps({**TINY_LLAMA, "num_hidden_layers": draft_layers})
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[(5 * j) % 250 + 1 for j in range(120)]]  # (runs to max_model_len, 128)
    prompts += [[(7 * i + j) % 250 + 1 for j in range(3 + 9 * i)] for i in range(5)]

    want = drain(make_core(tmp_path, "torch", False), prompts, params)
    assert len(want["r0"]) == 8  # (cut at max_model_len)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    core = make_core(tmp_path, "triton", False, speculative_config=spec)
    assert core.runner.enable_decode_graphs(False, 3)
    assert core.runner.draft is not None
    drafter = core.runner.draft.runner
    assert drafter.enable_decode_graphs(False, 3)
    drafter.enable_piece_graphs(capture=False)
    assert drain(core, prompts, params) == want
    assert core.runner.draft.num_split_passes > 0
    sched = core.scheduler
    kept = sched.num_accepted_tokens / sched.num_draft_tokens
    assert kept > 0.9 if draft_layers == 2 else kept < 0.9
    assert drafter.graphs is not None and sum(drafter.graphs.num_steps.values()) > 0
    assert drafter.pieces is not None and sum(drafter.pieces.num_steps.values()) > 0


def test_woken_graphs_are_made_again_and_match_reference(tmp_path: Path) -> None:
    """Sleep mode drops the graphs (their buffers' and weights' addresses go with the memory):
    waking makes the target's decode and piecewise graphs and the draft's again, as they were
    enabled, and the steps through them give the reference's tokens (level 2: the dummy
    weights drawn again, the same)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + 9 * i)] for i in range(5)]
    want = drain(make_core(tmp_path, "torch", False), prompts, params)
    spec = {"model": str(tmp_path), "num_speculative_tokens": 3}
    core = make_core(tmp_path, "triton", False, speculative_config=spec, enable_sleep_mode=True)
    runner = core.runner
    assert runner.draft is not None
    drafter = runner.draft.runner
    assert runner.enable_decode_graphs(False, 3) and drafter.enable_decode_graphs(False, 3)
    assert runner.enable_piece_graphs(capture=False)
    before = runner.graphs, runner.pieces, drafter.graphs
    core.sleep(2)
    assert runner.graphs is None and runner.pieces is None and drafter.graphs is None
    core.wake_up()
    after = runner.graphs, runner.pieces, drafter.graphs
    assert all(new is not None and new is not old for new, old in zip(after, before, strict=True))
    assert drain(core, prompts, params) == want
    for graphs in after:
        assert graphs is not None and sum(graphs.num_steps.values()) > 0

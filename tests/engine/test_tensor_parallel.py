"""Tensor parallelism on CPU (gloo): an engine split two ways across processes generates what
the same model generates in one process."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tiny_models import build_model, greedy_tokens, helper_dies_mid_step

from baton import LLM, SamplingParams
from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.errors import InvalidRequestError

PROMPTS = [[10 + i for i in range(n)] for n in (5, 23, 40, 70)]


# qwen2: biases on the split q/k/v; qwen2_moe: every expert split, a shared expert, a dense
# layer; phi3: q/k/v and gate/up fused in the checkpoint, half of each head turned (its q and
# k heads reordered on load, then split); granitemoe: experts stacked in the checkpoint,
# Granite's multipliers
@pytest.mark.parametrize(
    "arch", ["llama", "qwen2", "qwen2_moe", "phi3-partial-rotary", "granitemoe", "gemma3"]
)
def test_two_ranks_generate_what_one_does(arch: str, default_model_dir: Path, tmp_path: Path):
    build_model(arch, default_model_dir, tmp_path)
    want = greedy_tokens(tmp_path, PROMPTS, 12, kv_cache_memory=1 << 24)
    # a small step budget: prompts in chunks, mixed with the others' decodes
    got = greedy_tokens(
        tmp_path,
        PROMPTS,
        12,
        kv_cache_memory=1 << 24,
        tensor_parallel_size=2,
        max_num_batched_tokens=32,
    )
    assert got == want


def test_two_ranks_keep_the_drafts_rank_0_keeps(default_model_dir: Path, tmp_path: Path):
    """Speculative decoding split two ways: every rank records the drafts rank 0's check kept
    (broadcast), and the tokens are those of one process without drafts."""
    build_model("llama", default_model_dir, tmp_path)
    prompts = [[10 + i % 7 for i in range(n)] for n in (15, 30)]  # (drafts from the start)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    want = greedy_tokens(tmp_path, prompts, 16, kv_cache_memory=1 << 24)
    got = greedy_tokens(
        tmp_path,
        prompts,
        16,
        kv_cache_memory=1 << 24,
        tensor_parallel_size=2,
        speculative_config=spec,
    )
    assert got == want


def test_two_ranks_split_a_draft_model_as_the_model(default_model_dir: Path, tmp_path: Path):
    """A draft model under tensor parallelism: each rank holds its heads of the draft (and of
    its KV), and every rank feeds rank 0's drafts to its next pass. The model as its own draft
    keeps nearly all its drafts; the tokens are one process's without drafts."""
    build_model("llama", default_model_dir, tmp_path)
    prompts = [[10 + i % 7 for i in range(n)] for n in (15, 30)]
    want = greedy_tokens(tmp_path, prompts, 16, kv_cache_memory=1 << 24)
    spec = {"model": str(tmp_path), "num_speculative_tokens": 3}
    llm = LLM(
        str(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory=1 << 24,
        tensor_parallel_size=2, speculative_config=spec,
    )  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        core = llm.engine.core
        assert core.runner.draft is not None  # (rank 0's share: 1 of the 2 KV heads)
        assert core.runner.draft.runner.model_config.num_kv_heads == 1
        sched = core.scheduler
        assert sched.num_draft_tokens > 10
        assert sched.num_accepted_tokens / sched.num_draft_tokens > 0.8
    finally:
        llm.shutdown()


def test_two_ranks_sleep_wake_and_profile_as_one(default_model_dir: Path, tmp_path: Path):
    """Sleep mode split two ways: every rank drops its weights and KV (level 2) and reads its
    shard again on waking; the tokens after are one process's. Profiled, each rank writes
    its own trace. Prompts given as their tokens' embeddings (every rank writes the rows over
    its inputs) generate the tokens' outputs."""
    build_model("llama", default_model_dir, tmp_path)
    want = greedy_tokens(tmp_path, PROMPTS, 12, kv_cache_memory=1 << 24)
    traces = tmp_path / "traces"
    llm = LLM(
        str(tmp_path), dtype="float32", max_model_len=512, kv_cache_memory=1 << 24,
        tensor_parallel_size=2, enable_sleep_mode=True, enable_prompt_embeds=True,
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(traces)},
    )  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        for level in (2, 1):
            llm.sleep(level)
            assert llm.is_sleeping()
            llm.wake_up(["weights"])
            assert llm.collective_rpc("reload_weights") == [None, None]  # (vLLM's sequence)
            llm.wake_up(["kv_cache"])
            outs = llm.generate(prompts, greedy, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outs] == want
        llm.start_profile()
        llm.generate(prompts[:1], greedy, use_tqdm=False)
        llm.stop_profile()
        names = sorted(p.name.split("-")[0] for p in traces.glob("*.pt.trace.json.gz"))
        assert names == ["rank0", "rank1"], names
        table = llm.engine.core.runner.model.embed_tokens.weight.detach()
        embeds = [{"prompt_embeds": table[p]} for p in PROMPTS]
        outs = llm.generate(embeds, greedy, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
    finally:
        llm.shutdown()


def test_two_ranks_move_their_heads_through_the_host_tier(default_model_dir: Path, tmp_path):
    """--kv-offloading-size split two ways: each rank saves and loads its heads of the blocks
    the scheduler moves; the prefix found in the tier gives the tokens of one process whose
    pool kept it."""
    build_model("llama", default_model_dir, tmp_path)
    first, second = [10 + i % 97 for i in range(300)], [200 + i % 89 for i in range(300)]

    def run(**engine_args: object) -> tuple[list[list[int]], int]:
        llm = LLM(str(tmp_path), dtype="float32", max_model_len=320, **engine_args)
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outs = [
                llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)[0]
                for p in (first, second, first)
            ]
            assert outs[2].num_cached_tokens == 288  # (all but the last token's block)
            return [list(o.outputs[0].token_ids) for o in outs], llm.engine.core.kv.num_host_hits
        finally:
            llm.shutdown()

    want, _ = run(num_gpu_blocks_override=64)
    got, host_hits = run(
        num_gpu_blocks_override=24, kv_offloading_size=0.01, tensor_parallel_size=2
    )
    assert host_hits > 100
    assert got == want


def test_a_model_that_does_not_split_evenly_is_refused(default_model_dir: Path, tmp_path: Path):
    build_model("llama", default_model_dir, tmp_path)  # 4 attention heads, 2 KV heads
    with pytest.raises(InvalidRequestError, match="does not divide the model's attention heads"):
        LLM(str(tmp_path), tensor_parallel_size=3)


def test_a_draft_that_does_not_split_evenly_is_refused(default_model_dir: Path, tmp_path: Path):
    build_model("llama", default_model_dir, tmp_path / "model")  # 4 attention heads
    build_model(
        "llama", default_model_dir, tmp_path / "draft", num_attention_heads=1,
        num_key_value_heads=1,
    )  # fmt: skip
    spec = {"model": str(tmp_path / "draft"), "num_speculative_tokens": 2}
    with pytest.raises(InvalidRequestError, match=r"the draft model: .*does not divide"):
        LLM(str(tmp_path / "model"), tensor_parallel_size=2, speculative_config=spec)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this host has two GPUs")
def test_more_ranks_than_gpus_is_refused(default_model_dir: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size 2 needs 2 GPUs"):
        LLM(str(default_model_dir), device="cuda", tensor_parallel_size=2)


def test_a_dead_helper_rank_fails_the_engine_fast(default_model_dir: Path, tmp_path: Path):
    """A helper process that dies makes the next step raise a clear error instead of leaving
    rank 0 waiting in a collective."""
    build_model("llama", default_model_dir, tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
              tensor_parallel_size=2)  # fmt: skip
    try:
        helper = llm.engine.core._tp._procs[0]  # type: ignore[union-attr]
        helper.kill()
        helper.join(10)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=4))
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()


def _spawned_children() -> list[int]:
    """The pids of this process's children started by multiprocessing's spawn."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid() and b"spawn_main" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except (ValueError, OSError):  # not a process, or gone
            continue
    return pids


def test_a_helper_rank_that_dies_at_start_up_fails_the_start_fast(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """A helper that dies before it joins the group (killed here as soon as it exists) fails
    the engine's start with an error naming it, instead of leaving rank 0 in the group's
    rendezvous until its timeout; no process is left behind."""
    build_model("llama", default_model_dir, tmp_path)
    killed_at: list[float] = []

    def kill_the_helper() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed_at:
            for pid in _spawned_children():
                os.kill(pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
            time.sleep(0.005)

    killer = threading.Thread(target=kill_the_helper)
    killer.start()
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 is gone") as e:
            LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
                tensor_parallel_size=2)  # fmt: skip
        failed_at = time.monotonic()
    finally:
        killer.join()
    assert killed_at, "no helper process was seen"
    assert failed_at - killed_at[0] < 10, str(e.value)
    assert not _spawned_children()


def test_a_helper_rank_that_dies_inside_a_collective_fails_the_engine_fast(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 waiting in a collective for a helper that then dies gets a clear error, not a
    hang, and the engine still shuts down."""
    build_model("llama", default_model_dir, tmp_path)
    error, after_kill_s, shutdown_s = helper_dies_mid_step(tmp_path, kv_cache_memory=1 << 24)
    assert "tensor-parallel rank 1 is gone" in error
    assert after_kill_s < 10
    assert shutdown_s < 40


# (an FP8 cache: its blocks move between the ranks as bytes, which gloo takes)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_split_decode_engine_continues_from_a_whole_prefill_engines_kv(
    default_model_dir: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    """Disaggregation into a tensor-parallel engine: the prefill engine (one rank) holds the
    prompts' whole KV; the decode engine (two ranks) loads it, each rank keeping its heads
    (``load_kv_blocks``), and generates the same greedy tokens as one engine doing both."""
    build_model("llama", default_model_dir, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cache = {"kv_cache_memory": 1 << 24, "kv_cache_dtype": kv_cache_dtype}
    want = greedy_tokens(tmp_path, PROMPTS, 10, **cache)
    engine = {"model": str(tmp_path), "dtype": "float32", "max_model_len": 512, **cache}
    prefill = EngineCore(EngineConfig(**engine))  # type: ignore[arg-type]
    decode = EngineCore(EngineConfig(**engine, tensor_parallel_size=2))  # type: ignore[arg-type]
    try:
        assert _disaggregate(prefill, decode, prefill.kv_pool, params) == want
        decode.check_invariants()
    finally:
        decode.shutdown()


def _disaggregate(
    prefill: EngineCore,
    decode: EngineCore,
    source: torch.Tensor,
    params: SamplingParams,
    after_prefill: Callable[[], None] = lambda: None,
) -> list[list[int]]:
    """Prefill ``PROMPTS`` on ``prefill``, have ``decode`` load their KV from ``source`` at
    the prefilled outputs' block ids (releasing them), and decode: each prompt's greedy
    tokens."""
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
    held, first = {}, {}
    while prefill.has_schedulable_requests():
        for out in prefill.step():
            assert out.finish_reason == "prefilled" and out.kv_block_ids is not None
            held[out.req_id], first[out.req_id] = out.kv_block_ids, out.new_token_ids[0]
            decode.add_request(
                out.req_id,
                PROMPTS[int(out.req_id[1:])],
                params,
                remote_kv="handle",
                first_token_id=out.new_token_ids[0],
            )
    after_prefill()
    decode.step()  # admission: the requests wait for their KV
    for load in decode.take_kv_loads():
        remote = held[load.req_id][load.first_block :]
        decode.load_kv_blocks(load.local_block_ids, source[remote])
        decode.finish_kv_load(load.req_id, ok=True)
        assert prefill.release_held(load.req_id)
    got: dict[str, list[int]] = {}
    while decode.has_schedulable_requests():
        for out in decode.step():
            got.setdefault(out.req_id, []).extend(out.new_token_ids)
    return [[first[f"r{i}"], *got[f"r{i}"]] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_whole_decode_engine_continues_from_a_split_prefill_engines_export(
    default_model_dir: Path, tmp_path: Path, kv_cache_dtype: str
) -> None:
    """A prefill engine split across two ranks gathers each prompt's heads from its ranks into
    whole blocks (``enable_kv_export``); an engine of one rank loads those and generates the
    same greedy tokens as one engine doing both. The pool's blocks are released once exported
    (kept in the prefix cache), the export rows when the pull is done."""
    build_model("llama", default_model_dir, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    cache = {"kv_cache_memory": 1 << 24, "kv_cache_dtype": kv_cache_dtype}
    want = greedy_tokens(tmp_path, PROMPTS, 10, **cache)
    engine = {"model": str(tmp_path), "dtype": "float32", "max_model_len": 512, **cache}
    prefill = EngineCore(EngineConfig(**engine, tensor_parallel_size=2))  # type: ignore[arg-type]
    decode = EngineCore(EngineConfig(**engine))  # type: ignore[arg-type]
    try:
        export = prefill.enable_kv_export(64)
        assert export.shape[1:] == decode.kv_pool.shape[1:]  # whole blocks: all the heads
        assert export.dtype == decode.kv_pool.dtype
        assert prefill.kv_pool.shape[-2] * 2 == export.shape[-2]

        def released_once_gathered() -> None:  # to the prefix cache
            assert prefill.kv.usage() == 0.0

        assert _disaggregate(prefill, decode, export, params, released_once_gathered) == want
        prefill.check_invariants()  # every export row is free again
        assert not prefill.release_held("r0")
    finally:
        prefill.shutdown()


def test_a_prefilled_prompt_waits_for_room_in_the_export_area(
    default_model_dir: Path, tmp_path: Path
) -> None:
    """An export area that holds one prompt: the second prefilled prompt's output is held
    back (and the engine does not spin on it) until the first's rows are released; a prompt
    aborted while it waits frees its pool blocks. An area smaller than one max_model_len
    prompt is refused."""
    build_model("llama", default_model_dir, tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", max_model_len=80, kv_cache_memory=1 << 24,
        tensor_parallel_size=2,
    )  # fmt: skip
    prefill = EngineCore(config)
    try:
        with pytest.raises(InvalidRequestError, match="export area of 4 blocks"):
            prefill.enable_kv_export(4)  # 80 tokens need 5 blocks of 16
        prefill.enable_kv_export(5)
        for req_id, prompt in {"a": PROMPTS[3], "b": PROMPTS[3][::-1], "c": PROMPTS[2]}.items():
            prefill.add_request(req_id, prompt, params, prefill_only=True)
        done: list[str] = []
        while prefill.has_schedulable_requests():
            done += [out.req_id for out in prefill.step()]
        assert len(done) == 1 and prefill.has_unfinished_requests()
        prefill.check_invariants()
        assert prefill.release_held(done[0])
        while prefill.has_schedulable_requests():
            done += [out.req_id for out in prefill.step()]
        assert len(done) == 2
        (waiting,) = {"a", "b", "c"} - set(done)
        prefill.abort_requests([waiting])
        assert prefill.release_held(waiting)  # its pool blocks
        assert prefill.release_held(done[1])
        assert not prefill.has_unfinished_requests()
        assert prefill.kv.usage() == 0.0
        prefill.check_invariants()
    finally:
        prefill.shutdown()


def test_two_ranks_run_multi_steps_as_one_does(default_model_dir: Path, tmp_path: Path) -> None:
    """Multi-step scheduling on a split engine: every rank runs the passes, each broadcasting
    rank 0's tokens before the next pass; the tokens are those of one process, one pass a
    step."""
    build_model("llama", default_model_dir, tmp_path)
    want = greedy_tokens(tmp_path, PROMPTS, 12, kv_cache_memory=1 << 24)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=1 << 24,
        tensor_parallel_size=2,
        num_scheduler_steps=4,
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        )
        assert llm.engine.core.scheduler.num_multi_steps > 0
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_two_ranks_serve_lora_adapters_as_one_does(default_model_dir: Path, tmp_path: Path):
    """LoRA adapters on a split engine: each rank takes its share of every adapter (rows of B
    for q/k/v/gate/up, columns of A for o/down), and the helper ranks read and drop adapters
    as rank 0 does (one slot and one adapter kept on the host: every switch between adapters
    drops one and reads the other; a third adapter loaded at run time). The tokens are those
    of one process, and each adapter changes them."""
    from lora_adapters import write_adapter

    from baton_engine.config import ModelConfig
    from baton_engine.lora import TARGETS, LoRARequest, part_shape

    model = tmp_path / "model"
    build_model("qwen2", default_model_dir, model)  # (biases on the split q/k/v)
    cfg = ModelConfig.from_path(model)
    shapes = {part: part_shape(cfg, part) for part in TARGETS}
    folders = [
        write_adapter(tmp_path / name, rank=rank, alpha=2 * rank, targets=targets, seed=seed,
                      shapes=shapes, num_layers=cfg.num_layers, scale=0.3)
        for name, rank, targets, seed in (
            ("every", 8, TARGETS, 1),
            ("attn", 4, ("q_proj", "k_proj", "v_proj", "o_proj"), 2),
            ("mlp", 8, ("gate_proj", "up_proj", "down_proj"), 3),
        )
    ]  # fmt: skip
    every, attn = (LoRARequest(f.name, i + 1, str(f)) for i, f in enumerate(folders[:2]))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]

    def run(tp: int) -> list[list[int]]:
        llm = LLM(str(model), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24,
                  tensor_parallel_size=tp, max_num_batched_tokens=32, enable_lora=True,
                  max_loras=1, max_cpu_loras=1, max_lora_rank=8)  # fmt: skip
        try:
            outs = llm.generate(prompts, params, lora_request=[None, every, attn, every])
            late = llm.engine.core.load_lora_adapter("mlp", str(folders[2]))
            outs += llm.generate(prompts[:2], params, lora_request=[late, None])
        finally:
            llm.shutdown()
        return [list(o.outputs[0].token_ids) for o in outs]

    want = run(1)
    assert run(2) == want
    base = greedy_tokens(model, PROMPTS[:2], 10, kv_cache_memory=1 << 24)
    assert [want[0], want[5]] == base  # the base model's requests
    assert want[1] != base[1] and want[4] != base[0]  # adapters change the answers
    assert want[2] != greedy_tokens(model, PROMPTS[2:3], 10, kv_cache_memory=1 << 24)[0]

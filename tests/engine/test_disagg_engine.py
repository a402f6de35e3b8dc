"""Disaggregation inside the engine: a prefill-only engine holds a prompt's blocks, a decode
engine fills its own blocks from them and generates the rest; the tokens equal one engine doing
both. The copy between the two pools stands in for the transfer (tested in libs/kvtransfer).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput, KVLoad
from baton_engine.errors import EngineBusyError
from baton_engine.sampling_params import SamplingParams

SYSTEM = list(range(1000, 1000 + 70))  # a shared prefix of 4 full blocks and a bit
OTHER_SYSTEM = list(range(6000, 6000 + 70))


def make_core(model_dir: Path, **overrides: object) -> EngineCore:
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=512,
        kv_cache_memory=64 << 20,
        attention_backend="torch",
        **overrides,  # type: ignore[arg-type]
    )
    return EngineCore(config)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def cores(
    default_model_dir: Path, request: pytest.FixtureRequest
) -> tuple[EngineCore, EngineCore, EngineCore]:
    """Async scheduling (step N+1 launched before step N's tokens are read) on the prefill and
    decode engines must change nothing; the reference always runs synchronously."""
    return (
        make_core(default_model_dir, async_scheduling=request.param),  # prefill worker
        make_core(default_model_dir, async_scheduling=request.param),  # decode worker
        make_core(default_model_dir, async_scheduling=False),  # aggregated reference
    )


def run(core: EngineCore) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(10_000):
        if not core.has_schedulable_requests():
            break
        for out in core.step():
            outputs.setdefault(out.req_id, []).append(out)
    return outputs


def tokens(outputs: list[EngineCoreOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def prompts() -> list[list[int]]:
    return [SYSTEM + [2000 + i, 3000 + 7 * i, 17 + i] * (1 + i % 4) for i in range(6)]


def copy_blocks(src: EngineCore, dst: EngineCore, load: KVLoad, src_blocks: list[int]) -> None:
    remote = src_blocks[load.first_block :]
    assert len(remote) == len(load.local_block_ids)
    dst.kv_pool[load.local_block_ids] = src.kv_pool[remote]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12),
    ],
    ids=["greedy", "seeded"],
)
def test_prefill_then_decode_equals_aggregated(
    cores: tuple[EngineCore, EngineCore, EngineCore], params: SamplingParams
) -> None:
    prefill, decode, aggregated = cores
    batch = prompts()
    for i, prompt in enumerate(batch):
        aggregated.add_request(f"r{i}", prompt, params)
        prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
    expected = {k: tokens(v) for k, v in run(aggregated).items()}
    prefilled = run(prefill)

    held: dict[str, list[int]] = {}
    for i, prompt in enumerate(batch):
        (out,) = prefilled[f"r{i}"]
        assert out.finish_reason == "prefilled"
        assert out.new_token_ids == expected[f"r{i}"][:1]
        assert out.kv_block_ids is not None
        assert len(out.kv_block_ids) == -(len(prompt) // -prefill.config.block_size)
        held[f"r{i}"] = out.kv_block_ids
        decode.add_request(
            f"r{i}", prompt, params, remote_kv=f"handle-{i}", first_token_id=out.new_token_ids[0]
        )
    prefill.check_invariants()

    decode.step()  # admission: every request goes to loading, nothing is computed
    loads = decode.take_kv_loads()
    assert sorted(load.req_id for load in loads) == sorted(held)
    assert not decode.has_schedulable_requests()
    for load in loads:
        assert load.remote == f"handle-{load.req_id[1:]}"
        copy_blocks(prefill, decode, load, held[load.req_id])
        decode.finish_kv_load(load.req_id, ok=True)
    for req_id in held:
        assert prefill.release_held(req_id)
    prefill.check_invariants()
    assert prefill.kv.num_free_blocks == prefill.kv.pool.num_blocks

    got = run(decode)
    for req_id, want in expected.items():
        assert [want[0], *tokens(got[req_id])] == want, req_id
    decode.check_invariants()
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks


def test_second_request_loads_only_uncached_blocks(
    cores: tuple[EngineCore, EngineCore, EngineCore],
) -> None:
    prefill, decode, _ = cores
    params = SamplingParams(temperature=0.0, max_tokens=4)
    block_size = decode.config.block_size
    loaded: list[int] = []
    for i in range(2):
        prompt = [*OTHER_SYSTEM, 4000 + i, 5000 + i]
        prefill.add_request(f"s{i}", prompt, params, prefill_only=True)
        (out,) = run(prefill)[f"s{i}"]
        assert out.kv_block_ids is not None
        decode.add_request(
            f"s{i}", prompt, params, remote_kv="h", first_token_id=out.new_token_ids[0]
        )
        decode.step()
        (load,) = decode.take_kv_loads()
        loaded.append(len(load.local_block_ids))
        copy_blocks(prefill, decode, load, out.kv_block_ids)
        decode.finish_kv_load(load.req_id, ok=True)
        prefill.release_held(f"s{i}")
        run(decode)
    # The shared prefix fills 4 blocks: the second request finds them in the decode worker's
    # own cache and pulls only its last block.
    assert loaded == [len(OTHER_SYSTEM) // block_size + 1, 1]
    decode.check_invariants()
    prefill.check_invariants()


def test_failed_load_recomputes_and_abort_while_loading_frees_late(
    cores: tuple[EngineCore, EngineCore, EngineCore],
) -> None:
    _, decode, aggregated = cores
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [*SYSTEM[:20], 77, 78, 79, 80, 81]
    aggregated.add_request("f", prompt, params)
    want = tokens(run(aggregated)["f"])

    decode.add_request("f", prompt, params, remote_kv="lost", first_token_id=want[0])
    decode.add_request("a", prompt, params, remote_kv="lost", first_token_id=want[0])
    decode.step()
    loads = {load.req_id: load for load in decode.take_kv_loads()}
    assert set(loads) == {"f", "a"}
    free_before = decode.kv.num_free_blocks

    decode.abort_requests(["a"])
    assert decode.kv.num_free_blocks == free_before  # a transfer may still be writing them
    decode.check_invariants()
    decode.finish_kv_load("a", ok=True)  # the late report frees them
    assert decode.kv.num_free_blocks > free_before

    decode.finish_kv_load("f", ok=False)  # the pull failed: compute the prompt here
    got = [want[0], *tokens(run(decode)["f"])]
    assert got == want
    decode.check_invariants()
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks
    assert torch.isfinite(decode.kv_pool).all()


def _pull(
    prefill: EngineCore, decode: EngineCore, batch: dict[str, list[int]], params: SamplingParams
) -> None:
    """Prefill ``batch`` on ``prefill``, then have ``decode`` pull each prompt's KV."""
    for req_id, prompt in batch.items():
        prefill.add_request(req_id, prompt, params, prefill_only=True)
    prefilled = run(prefill)
    for req_id, prompt in batch.items():
        (out,) = prefilled[req_id]
        decode.add_request(
            req_id, prompt, params, remote_kv="h", first_token_id=out.new_token_ids[0]
        )
    decode.step()
    for load in decode.take_kv_loads():
        out = prefilled[load.req_id][0]
        assert out.kv_block_ids is not None
        copy_blocks(prefill, decode, load, out.kv_block_ids)
        decode.finish_kv_load(load.req_id, ok=True)
        prefill.release_held(load.req_id)


def test_a_draft_model_computes_its_own_kv_of_a_pulled_prompt(default_model_dir: Path) -> None:
    """Disaggregated serving with a draft model: a pull brings the model's KV of a prompt, not
    the draft's, which the decode engine's draft then computes (from the first pulled
    position: the later requests find the shared prefix in the decode engine's cache and pull
    only the rest). The model as its own draft keeps nearly every draft; the tokens are one
    engine's without drafts."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    first = {"d0": [*SYSTEM, 11, 12, 13]}
    later = {f"d{i}": [*SYSTEM, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(1, 4)}
    reference = make_core(default_model_dir)
    for req_id, prompt in {**first, **later}.items():
        reference.add_request(req_id, prompt, params)
    expected = {k: tokens(v) for k, v in run(reference).items()}
    del reference

    prefill = make_core(default_model_dir)
    spec = {"model": str(default_model_dir), "num_speculative_tokens": 3}
    decode = make_core(default_model_dir, speculative_config=spec)
    got: dict[str, list[int]] = {}
    for batch in (first, later):
        _pull(prefill, decode, batch, params)
        for req_id, outs in run(decode).items():
            got[req_id] = [expected[req_id][0], *tokens(outs)]
    assert got == expected
    sched = decode.scheduler
    assert sched.num_draft_tokens > 50
    assert sched.num_accepted_tokens / sched.num_draft_tokens > 0.8
    decode.check_invariants()


def test_sleeping_with_requests_kept_waits_for_their_pulls(
    cores: tuple[EngineCore, EngineCore, EngineCore], default_model_dir: Path
) -> None:
    """A decode engine paused with keep sleeps with its requests only once their pulls have
    landed (busy before), and frees the pulled blocks too (those requests were not scheduled
    yet); woken, they compute their prompts themselves and end as the aggregated engine's."""
    prefill, _, aggregated = cores
    decode = make_core(default_model_dir, async_scheduling=True, enable_sleep_mode=True)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batch = {f"kept{i}": prompt for i, prompt in enumerate(prompts()[:3])}
    for req_id, prompt in batch.items():
        aggregated.add_request(req_id, prompt, params)
        prefill.add_request(req_id, prompt, params, prefill_only=True)
    expected = {k: tokens(v) for k, v in run(aggregated).items()}
    prefilled = run(prefill)
    for req_id, prompt in batch.items():
        first = prefilled[req_id][0].new_token_ids[0]
        decode.add_request(req_id, prompt, params, remote_kv="h", first_token_id=first)
    decode.step()
    loads = decode.take_kv_loads()
    decode.pause(keep=True)
    with pytest.raises(EngineBusyError, match="in flight"):
        decode.sleep(1, keep=True)
    for load in loads:
        out = prefilled[load.req_id][0]
        assert out.kv_block_ids is not None
        copy_blocks(prefill, decode, load, out.kv_block_ids)
        decode.finish_kv_load(load.req_id, ok=True)
        prefill.release_held(load.req_id)
    while decode.has_schedulable_requests():  # (the step in flight reports)
        decode.step()
    decode.sleep(1, keep=True)
    assert decode.kv.num_free_blocks == decode.kv.pool.num_blocks
    decode.wake_up()
    got = run(decode)
    for req_id, want in expected.items():
        assert [want[0], *tokens(got[req_id])] == want, req_id
    decode.check_invariants()

"""Async scheduling: the engine launches step N+1 before step N's sampled tokens reach the host,
so a stop is noticed one step late and the extra token must vanish. Whatever the requests ask for,
the outputs must equal a synchronous engine's, token for token, and the pool must end whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from baton_engine.config import EngineConfig
from baton_engine.core.engine_core import EngineCore
from baton_engine.core.outputs import EngineCoreOutput
from baton_engine.sampling_params import SamplingParams

SYSTEM = list(range(1000, 1000 + 40))


def make_core(model_dir: Path, async_scheduling: bool, **overrides: object) -> EngineCore:
    overrides = {"max_model_len": 256, "kv_cache_memory": 32 << 20, **overrides}
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        attention_backend="torch",
        async_scheduling=async_scheduling,
        **overrides,  # type: ignore[arg-type]
    )
    return EngineCore(config)


def run(
    core: EngineCore, abort_after: dict[str, int] | None = None
) -> dict[str, list[EngineCoreOutput]]:
    """Step until done; ``abort_after[req_id] = n`` aborts a request once it has n tokens."""
    outputs: dict[str, list[EngineCoreOutput]] = {}
    abort_after = dict(abort_after or {})
    for _ in range(5_000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            outputs.setdefault(out.req_id, []).append(out)
        for req_id, n in list(abort_after.items()):
            if sum(len(o.new_token_ids) for o in outputs.get(req_id, [])) >= n:
                core.abort_requests([req_id])
                del abort_after[req_id]
    assert not core.has_unfinished_requests()
    core.check_invariants()
    assert core.kv.num_free_blocks == core.kv.pool.num_blocks
    return outputs


def summary(outputs: dict[str, list[EngineCoreOutput]]) -> dict[str, tuple[list[int], str | None]]:
    return {
        req_id: ([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason)
        for req_id, outs in outputs.items()
    }


@pytest.fixture(scope="module")
def engines(default_model_dir: Path) -> tuple[EngineCore, EngineCore]:
    return make_core(default_model_dir, False), make_core(default_model_dir, True)


def workload(stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [
        ([*SYSTEM, 5, 6, 7], greedy),
        ([*SYSTEM, 8, 9], SamplingParams(temperature=0.0, max_tokens=1)),
        (
            [*SYSTEM, 10],
            SamplingParams(
                temperature=0.0, max_tokens=24, stop_token_ids=[stop_token], ignore_eos=True
            ),
        ),
        ([11, 12, 13, 14] * 9, SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9)),
        ([15, 16] * 7, SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3)),
        ([17, 18, 19], SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)),
        ([20, 21] * 5, SamplingParams(temperature=0.0, max_tokens=7, min_tokens=5)),
        ([*SYSTEM, 22, 23], SamplingParams(temperature=0.0, max_tokens=16)),  # may stop on EOS
    ]


def add_all(core: EngineCore, batch: list[tuple[list[int], SamplingParams]], tag: str) -> None:
    for i, (prompt, params) in enumerate(batch):
        core.add_request(f"{tag}{i}", prompt, params)


def test_async_equals_sync_for_every_kind_of_request(
    engines: tuple[EngineCore, EngineCore],
) -> None:
    sync, asyn = engines
    # a stop token that the greedy continuation of request 2 really produces mid-way
    probe = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    sync.add_request("probe", [*SYSTEM, 10], probe)
    probe_tokens = summary(run(sync))["probe"][0]
    at = next(i for i in range(3, 24) if probe_tokens[i] not in probe_tokens[:i])
    batch = workload(probe_tokens[at])
    add_all(sync, batch, "a")
    add_all(asyn, batch, "a")
    want, got = run(sync), run(asyn)
    assert summary(got) == summary(want)
    assert summary(got)["a2"] == (probe_tokens[: at + 1], "stop")
    assert summary(got)["a1"][1] == "length" and len(summary(got)["a1"][0]) == 1
    # batches differ between the two engines, so float sums may differ in the last bits
    for g, w in zip(got["a5"], want["a5"], strict=True):
        assert g.new_logprobs is not None and w.new_logprobs is not None
        assert g.new_logprobs[0].token_ids == w.new_logprobs[0].token_ids
        assert g.new_logprobs[0].logprobs == pytest.approx(w.new_logprobs[0].logprobs, abs=1e-4)


def test_async_equals_sync_with_aborts(engines: tuple[EngineCore, EngineCore]) -> None:
    sync, asyn = engines
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for core in engines:
        for i in range(4):
            core.add_request(f"b{i}", [*SYSTEM, 30 + i], params)
    abort = {"b1": 3, "b3": 7}
    want, got = summary(run(sync, abort)), summary(run(asyn, abort))
    for req_id in ("b0", "b2"):
        assert got[req_id] == want[req_id]
    for req_id, n in abort.items():  # ended by the abort (its caller reports it): a prefix
        assert got[req_id][1] is None
        assert got[req_id][0] == want[req_id][0][: len(got[req_id][0])]
        assert len(got[req_id][0]) >= n


def test_async_equals_sync_under_preemption(default_model_dir: Path) -> None:
    """A pool too small for every request at once: requests are preempted (some with a token
    still pending) and recomputed; the tokens do not change."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        core = make_core(default_model_dir, async_scheduling, num_gpu_blocks_override=24)
        for i in range(6):
            core.add_request(f"c{i}", [40 + i, 41, 42] * 12, params)
        results.append(summary(run(core)))
        assert core.scheduler.num_preemptions > 0
    assert results[1] == results[0]


def test_async_priority_scheduling_under_preemption(default_model_dir: Path) -> None:
    """Priority scheduling with the later requests ranked first: the earlier ones are now
    preempted (some with a token still pending) and wait behind the better-ranked; the tokens
    still equal a synchronous fcfs engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = []
    for async_scheduling, policy in ((False, "fcfs"), (True, "priority")):
        core = make_core(
            default_model_dir,
            async_scheduling,
            num_gpu_blocks_override=24,
            scheduling_policy=policy,
        )
        requests = []
        for i in range(6):
            priority = -i if policy == "priority" else 0
            core.add_request(f"c{i}", [40 + i, 41, 42] * 12, params, priority=priority)
            requests.append(core.scheduler.requests[f"c{i}"])
        results.append(summary(run(core)))
        assert core.scheduler.num_preemptions > 0
        first, last = requests[0].num_preemptions, requests[5].num_preemptions
        if policy == "fcfs":
            assert last and not first  # the last admitted goes first
        else:
            assert first and not last  # the worst-ranked goes first
    assert results[1] == results[0]


def test_async_scheduling_defaults_by_device() -> None:
    assert not EngineConfig(device="cpu").resolved_async_scheduling()
    assert EngineConfig(device="cuda").resolved_async_scheduling()
    assert not EngineConfig(device="cuda", async_scheduling=False).resolved_async_scheduling()

"""What ``baton serve`` starts: the services of each mode and, on GPUs, one GPU per worker."""

from __future__ import annotations

import argparse

import pytest

from baton.serve import (
    SHARED_CPU_ENV,
    _cpu_env,
    _gpu_counts,
    _gpu_env,
    _gpu_ids,
    _plan,
    add_parser,
    share_gpu_memory,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_disaggregated_by_default_and_aggregated_on_request() -> None:
    plan = _plan(parse("--num-decode", "2"), "m")
    assert [label for _, label, _ in plan] == [
        "kvstore",
        "prefill",
        "decode-0",
        "decode-1",
        "gateway",
    ]
    kvstore = plan[0][2][plan[0][2].index("--port") + 1]
    for kind, _, argv in plan[1:]:  # every worker and the gateway find the kvstore
        assert f"127.0.0.1:{kvstore}" in argv, kind
    gateway = plan[-1][2]
    assert gateway.count("--decode-addr") == 2 and gateway.count("--prefill-addr") == 1
    aggregated = _plan(parse("--mode", "aggregated"), "m")
    assert [label for _, label, _ in aggregated] == ["decode", "gateway"]
    assert "--max-remote-prefill-wait-ms" not in gateway  # always remote unless asked
    shed = _plan(parse("--max-remote-prefill-wait-ms", "300"), "m")[-1][2]
    assert shed[shed.index("--max-remote-prefill-wait-ms") + 1] == "300.0"


@pytest.mark.parametrize(
    ("flag", "value", "bad"),
    [("--scheduling-policy", "priority", "lifo"), ("--runner", "pooling", "embed")],
)
def test_engine_flags_reach_every_worker(flag: str, value: str, bad: str) -> None:
    """vLLM's ``--scheduling-policy`` and ``--runner`` are engine flags: every worker gets
    them, the gateway not; the defaults are left to the workers' own."""
    for mode in ("disaggregated", "aggregated"):
        plan = _plan(parse("--mode", mode, flag, value), "m")
        for kind, label, argv in plan:
            given = flag in argv
            assert given == (kind in ("prefill", "decode")), label
            if given:
                assert argv[argv.index(flag) + 1] == value
    assert all(flag not in argv for _, _, argv in _plan(parse(), "m"))
    with pytest.raises(SystemExit):
        parse(flag, bad)


def test_lora_flags_reach_every_worker() -> None:
    """``--enable-lora --lora-modules a=x b=y`` (and the JSON form) reach each worker as given:
    the gateway learns the adapters from the workers."""
    spec = '{"name": "b", "path": "/y"}'
    args = parse("--enable-lora", "--max-loras", "2", "--lora-modules", "a=/x", spec)
    for kind, label, argv in _plan(args, "m"):
        if kind not in ("prefill", "decode"):
            assert "--enable-lora" not in argv and "--lora-modules" not in argv, label
            continue
        assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "2", label
        i = argv.index("--lora-modules")
        assert argv[i + 1 : i + 3] == ["a=/x", spec], label


def test_frontend_flags_reach_the_gateway_only() -> None:
    """vLLM's ``--response-role`` (and the other chat options) are the gateway's: its own
    parser reads them from the argv ``baton serve`` builds; the workers never get them."""
    from baton_gateway.cli import add_arguments

    gateway_parser = argparse.ArgumentParser()
    add_arguments(gateway_parser)
    for role, argv_extra in (("assistant", ()), ("narrator", ("--response-role", "narrator"))):
        plan = _plan(parse("--reasoning-parser", "qwen3", *argv_extra), "m")
        for kind, label, argv in plan:
            if kind != "gateway":
                assert "--response-role" not in argv and "--reasoning-parser" not in argv, label
                continue
            args = gateway_parser.parse_args(argv)
            assert (args.response_role, args.reasoning_parser) == (role, "qwen3")


def test_workers_get_one_gpu_each_round_robin() -> None:
    args = parse("--device", "cuda", "--gpus", "2,3", "--num-decode", "2")
    gpus = _gpu_ids(args)
    workers = ["prefill", "decode-0", "decode-1"]
    envs = [_gpu_env(gpus, workers, w, [1, 1, 1]) for w in workers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["2", "3", "2"]
    assert all(e["NCCL_NVLS_ENABLE"] == "0" for e in envs)
    assert _gpu_env(gpus, workers, "gateway", [1, 1, 1]) == {}
    assert _gpu_ids(parse("--gpus", "0,1")) == []  # on CPU nothing is pinned


def test_cpu_workers_that_share_the_cores_spin_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU, several workers (a prefill and a decode worker) get ``SHARED_CPU_ENV``: their
    OpenMP threads soon stop spinning. A lone worker, the gateway, GPU workers and a user's
    own OpenMP wait settings are left alone."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)

    def envs(args: argparse.Namespace) -> dict[str, dict[str, str]]:
        labels = [label for _, label, _ in _plan(args, "m")]
        workers = [label for label in labels if label.startswith(("prefill", "decode"))]
        return {label: _cpu_env(args, workers, label) for label in labels}

    assert SHARED_CPU_ENV["GOMP_SPINCOUNT"] == "1000"
    assert envs(parse()) == {"kvstore": {}, "prefill": SHARED_CPU_ENV,
                             "decode": SHARED_CPU_ENV, "gateway": {}}  # fmt: skip
    assert envs(parse("--mode", "aggregated", "--num-decode", "2"))["decode-1"] == SHARED_CPU_ENV
    assert envs(parse("--mode", "aggregated")) == {"decode": {}, "gateway": {}}
    assert not any(envs(parse("--device", "cuda", "--gpus", "0,1")).values())
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not any(envs(parse()).values())


def test_tensor_parallel_workers_get_that_many_gpus_and_run_aggregated() -> None:
    args = parse("--device", "cuda", "--gpus", "0,1,2,3", "--num-decode", "2", "-tp", "2")
    plan = _plan(args, "m")
    assert args.mode == "aggregated"  # the default with tensor parallelism
    assert [label for _, label, _ in plan] == ["decode-0", "decode-1", "gateway"]
    workers = ["decode-0", "decode-1"]
    envs = [_gpu_env(_gpu_ids(args), workers, w, _gpu_counts(args, plan)) for w in workers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]


def test_disaggregated_with_tensor_parallelism_splits_every_worker() -> None:
    """Prefill workers take ``--prefill-tensor-parallel-size`` GPUs (default: ``-tp``), decode
    workers ``-tp``."""
    args = parse("--device", "cuda", "--gpus", "0,1,2,3", "-tp", "2", "--mode", "disaggregated")
    plan = _plan(args, "m")
    workers = [label for kind, label, _ in plan if kind in ("prefill", "decode")]
    assert workers == ["prefill", "decode"]
    counts = _gpu_counts(args, plan)
    assert counts == [2, 2]
    envs = [_gpu_env(_gpu_ids(args), workers, w, counts) for w in workers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]

    args = parse("--device", "cuda", "--gpus", "0,1,2", "-tp", "2", "--mode", "disaggregated",
                 "--prefill-tensor-parallel-size", "1")  # fmt: skip
    plan = _plan(args, "m")
    counts = _gpu_counts(args, plan)
    assert counts == [1, 2]
    envs = [_gpu_env(_gpu_ids(args), workers, w, counts) for w in workers]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1,2"]
    prefill = next(a for _, label, a in plan if label == "prefill")
    last = max(i for i, a in enumerate(prefill) if a == "--tensor-parallel-size")
    assert prefill[last + 1] == "1"  # the last one given wins


def _utilization(*argv: str) -> dict[str, str | None]:
    """Each worker's ``--gpu-memory-utilization`` after ``share_gpu_memory`` (None: not set,
    the engine's default or the one forwarded for every worker)."""
    args = parse("--device", "cuda", *argv)
    plan = _plan(args, "m")
    share_gpu_memory(args, plan, _gpu_ids(args))
    out: dict[str, str | None] = {}
    for kind, label, a in plan:
        if kind in ("prefill", "decode"):
            last = [i for i, x in enumerate(a) if x == "--gpu-memory-utilization"]
            out[label] = a[last[-1] + 1] if last else None
    return out


def test_workers_sharing_a_gpu_split_its_memory() -> None:
    """Prefill and decode on one GPU take half the utilisation each; workers with GPUs of
    their own keep theirs; an explicit KV size leaves it alone."""
    assert _utilization("--gpus", "0") == {"prefill": "0.45", "decode": "0.45"}
    assert _utilization("--gpus", "0", "--gpu-memory-utilization", "0.8") == {
        "prefill": "0.4",
        "decode": "0.4",
    }
    assert _utilization("--gpus", "0,1") == {"prefill": None, "decode": None}
    assert _utilization("--gpus", "0,1,2", "--num-decode", "2") == {
        "prefill": None,
        "decode-0": None,
        "decode-1": None,
    }
    # three workers on two GPUs: GPU 0 holds the prefill worker and decode-1
    assert _utilization("--gpus", "0,1", "--num-decode", "2") == {
        "prefill": "0.45",
        "decode-0": None,
        "decode-1": "0.45",
    }
    # two workers of two ranks each on two GPUs
    assert _utilization("--gpus", "0,1", "-tp", "2", "--mode", "disaggregated") == {
        "prefill": "0.45",
        "decode": "0.45",
    }
    assert _utilization("--gpus", "0", "--num-gpu-blocks-override", "100") == {
        "prefill": None,
        "decode": None,
    }
    args = parse("--gpus", "0")  # on CPU nothing is pinned, nothing shared
    assert share_gpu_memory(args, _plan(args, "m"), _gpu_ids(args)) == []


def test_services_get_distinct_ports_never_the_gateways(monkeypatch: pytest.MonkeyPatch) -> None:
    """A port found free is free again once found, so the search can return it twice, or return
    the user's ``--port`` (free until the gateway binds it, after the workers are up): the
    kvstore, each worker's gRPC and metrics ports are all distinct and never the gateway's."""
    from baton import serve

    found = iter([8123, 9001, 9001, 9002, 8123, 9002, 9003, 9004, 9005, 9006, 9007, 9008])
    monkeypatch.setattr(serve, "free_port", lambda host="127.0.0.1": next(found))
    plan = _plan(parse("--port", "8123", "--num-decode", "2"), "m")
    ports = [argv[argv.index(flag) + 1] for kind, _, argv in plan if kind != "gateway"
             for flag in ("--port", "--metrics-port") if flag in argv]  # fmt: skip
    assert len(ports) == 7  # the kvstore's, then two for each of three workers
    assert len(set(ports)) == len(ports) and "8123" not in ports
    gateway = plan[-1][2]
    assert gateway[gateway.index("--port") + 1] == "8123"

"""vLLM's flags on Baton's command lines and in ``LLM(...)``: a vLLM command line parses
unchanged; a value Baton cannot honour is a clear error before anything starts; one that
changes nothing here is logged with what Baton does instead."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import pytest

from baton.cli import build_parser, with_config_file
from baton.cli import main as baton_main
from baton_engine.arg_utils import engine_kwargs_from_args
from baton_engine.errors import InvalidRequestError
from baton_engine.vllm_flags import (
    ENGINE_FLAGS,
    FRONTEND_FLAGS,
    check_flags,
    take_engine_args,
)

# A command line as vLLM's docs and deployment guides write them.
VLLM_COMMAND_LINE = [
    "--model", "/models/m",
    "--trust-remote-code",
    "--tensor-parallel-size", "1",
    "--gpu-memory-utilization", "0.9",
    "--max-model-len", "4096",
    "--enable-chunked-prefill",
    "--swap-space", "16",
    "--disable-log-requests",
    "--disable-log-stats",
    "--download-dir", "/cache",
    "--revision", "main",
    "--tokenizer-mode", "auto",
    "--kv-cache-dtype", "auto",
    "--max-logprobs", "5",
    "--otlp-traces-endpoint", "localhost:4317",
    "--enable-prompt-tokens-details",
    "--disable-fastapi-docs",
    "-O", "3",
    "--uvicorn-log-level", "warning",
    "--distributed-executor-backend", "mp",
    "--cuda-graph-sizes", "1", "2", "4", "8",
    "--guided-decoding-backend", "xgrammar",
    "--structured-outputs-config", '{"backend": "xgrammar"}',
    "--enable-reasoning",
    "--disable-frontend-multiprocessing",
    "--use-v2-block-manager",
    "--preemption-mode", "recompute",
    "--hf-token", "hf_abc",
]  # fmt: skip


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_a_vllm_command_line_parses_and_maps_onto_batons_flags() -> None:
    args = parse("serve", *VLLM_COMMAND_LINE)
    assert args.model_option == "/models/m" and args.otlp_endpoint == "localhost:4317"
    assert args.uvicorn_log_level == "warning" and args.disable_log_stats
    notes = check_flags(vars(args), ENGINE_FLAGS + FRONTEND_FLAGS)
    said = "\n".join(notes)
    assert args.cuda_graph_sizes == [1, 2, 4, 8]
    for flag in ("--trust-remote-code", "--swap-space", "--download-dir", "--cuda-graph-sizes"):
        assert flag in said
    assert "--kv-cache-dtype" not in said  # (an engine flag of Baton's)
    kwargs = engine_kwargs_from_args(args)  # only Baton's engine arguments
    assert kwargs["max_model_len"] == 4096 and kwargs["gpu_memory_utilization"] == 0.9
    assert not {f.name for f in ENGINE_FLAGS} & set(kwargs)
    # Each service's own command line takes vLLM's flags that concern it.
    for service in ("decode", "prefill"):
        worker = parse(service, "--trust-remote-code", "--swap-space", "4", "--seed", "1")
        assert worker.trust_remote_code and worker.swap_space == 4.0
    gateway = parse("gateway", "--disable-log-requests", "--max-log-len", "100")
    assert gateway.disable_log_requests and gateway.max_log_len == 100


@pytest.mark.parametrize(
    ("value", "tokens"), [("4096", 4096), ("32k", 32000), ("32K", 32768), ("25.6k", 25600),
                          ("1M", 1 << 20), ("1m", 10**6)],
)  # fmt: skip
def test_lengths_take_vllms_suffixes(value: str, tokens: int) -> None:
    """vLLM's --max-model-len 32k (decimal, lower case) or 32K (binary, upper case)."""
    args = parse("serve", "--max-model-len", value, "--max-num-batched-tokens", value)
    assert args.max_model_len == tokens and args.max_num_batched_tokens == tokens


@pytest.mark.parametrize("value", ["1.5K", "1.5", "32 k", "lots"])
def test_a_length_that_does_not_read_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse("serve", "--max-model-len", value)
    assert "--max-model-len" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--quantization", "gptq"], "quantization 'gptq' is not supported: Baton serves fp8"),
        (["--kv-cache-dtype", "fp8_inc"], "kv_cache_dtype 'fp8_inc' is not supported"),
        (["--pipeline-parallel-size", "2"], "--tensor-parallel-size only"),
        (["-pp", "2"], "--tensor-parallel-size only"),
        (["--data-parallel-size", "2", "--num-decode", "3"], "both count the decode workers"),
        (["--distributed-executor-backend", "ray"], "Ray is not supported"),
        (["--tokenizer-mode", "mistral"], "'mistral' and 'custom' are not supported"),
        (["--max-logprobs", "50"], "at most 20 logprobs per token"),
        (["--speculative-config", '{"method": "eagle", "model": "x"}'], "EAGLE, Medusa and MTP"),
        (["--speculative-config", '{"method": "ngram"}'], "num_speculative_tokens must be"),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, '
                '"prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            ],
            "above",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2, '
                '"acceptance_method": "typical_acceptance_sampler"}',
            ],
            "['acceptance_method'] are not supported",
        ),
        (
            [
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
                "--num-scheduler-steps",
                "4",
            ],
            "cannot be combined",
        ),
        (
            ["--speculative-config", '{"model": "/no/such/draft", "num_speculative_tokens": 2}'],
            "/no/such/draft",
        ),
        (["--cpu-offload-gb", "8"], "none are offloaded"),
        (["--kv-transfer-config", '{"kv_connector": "NixlConnector"}'], "disaggregates"),
        (["--api-server-count", "4"], "one gateway"),
        (["--headless"], "always has its gateway"),
        (["--hf-overrides", "[2]"], "hf_overrides must be a JSON object"),
        (["--guided-decoding-backend", "outlines"], "XGrammar"),
        (["--structured-outputs-config", '{"backend": "guidance"}'], "XGrammar"),
        (["--structured-outputs-config.backend", "outlines"], "XGrammar"),
        (["--preemption-mode", "swap"], "nothing is swapped"),
        (["--rope-theta", "500000"], "--hf-overrides"),
        (
            [
                "--logits-processors",
                "my.Proc",
                "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 2}',
            ],
            "neither speculative decoding",
        ),
        (["--enable-lora-bias"], "LoRA bias"),
        (["--data-parallel-size-local", "2"], "--num-decode"),
    ],
)
def test_a_value_baton_cannot_serve_stops_serve_before_it_starts(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert baton_main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_speculative_config_reaches_the_workers_engines() -> None:
    """``baton serve --speculative-config JSON`` hands it to each worker's command line, whose
    engine then speculates."""
    from baton.serve import engine_argv
    from baton_engine.config import EngineConfig, SpeculativeConfig

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    argv = engine_argv(parse("serve", "--speculative-config", spec))
    assert argv == ["--speculative-config", spec]
    worker = EngineConfig(**engine_kwargs_from_args(parse("decode", *argv)))
    assert worker.speculative() == SpeculativeConfig(3, 4, 4)


@pytest.mark.parametrize("mode", [None, "aggregated"])
def test_a_draft_model_runs_on_the_decode_workers(mode: str | None) -> None:
    """``baton serve --speculative-config '{"model": ...}'``: each decode worker loads the
    draft (computing its KV of the prompts it pulls); prefill workers, which give a prompt's
    first token only, load none."""
    from baton.serve import _plan

    spec = '{"model": "/models/draft", "num_speculative_tokens": 4}'
    argv = ["--speculative-config", spec, *(("--mode", mode) if mode else ())]
    plan = _plan(parse("serve", *argv), "m")
    kinds = ["kvstore", "prefill", "decode", "gateway"] if mode is None else ["decode", "gateway"]
    assert [kind for kind, _, _ in plan] == kinds
    for kind, _, worker in plan:
        if kind == "decode":
            assert worker[worker.index("--speculative-config") + 1] == spec
        elif kind == "prefill":
            assert "--speculative-config" not in worker
            engine_kwargs_from_args(parse("prefill", *worker))


@pytest.mark.parametrize(
    ("argv", "kinds"),
    [
        (["--data-parallel-size", "2"], ["decode", "decode", "gateway"]),
        (["-dp", "3", "--num-decode", "3"], ["decode", "decode", "decode", "gateway"]),
        (
            ["-dp", "2", "--mode", "disaggregated"],
            ["kvstore", "prefill", "decode", "decode", "gateway"],
        ),
    ],
)
def test_data_parallel_size_counts_the_decode_workers(argv: list[str], kinds: list[str]) -> None:
    """vLLM's ``--data-parallel-size N`` (N whole engines behind one API server): N decode
    workers, aggregated unless ``--mode`` says otherwise, none of them given the flag."""
    from baton.serve import _plan

    plan = _plan(parse("serve", *argv), "m")
    assert [kind for kind, _, _ in plan] == kinds
    for kind, _, worker in plan:
        assert "--data-parallel-size" not in worker and "-dp" not in worker
        if kind == "decode":  # (each a whole engine: the flag's 1 parses on a worker)
            engine_kwargs_from_args(parse("decode", *worker))


def test_kv_cache_dtype_and_quantization_reach_the_workers_engines() -> None:
    """``baton serve --kv-cache-dtype fp8 -q fp8`` hands both to each worker's command line."""
    from baton.serve import engine_argv
    from baton_engine.config import EngineConfig

    argv = engine_argv(parse("serve", "--kv-cache-dtype", "fp8", "-q", "fp8"))
    assert argv == ["--kv-cache-dtype", "fp8", "--quantization", "fp8"]
    worker = EngineConfig(**engine_kwargs_from_args(parse("decode", *argv)))
    assert worker.kv_cache_dtype == "fp8" and worker.quantization == "fp8"


def test_kv_offloading_reaches_the_workers_engines() -> None:
    """``baton serve --kv-offloading-size 2.5`` (GiB, as vLLM's) hands it to each worker;
    ``--kv-offloading-backend lmcache`` stops serve before it starts."""
    from baton.serve import engine_argv
    from baton_engine.config import EngineConfig

    argv = engine_argv(parse("serve", "--kv-offloading-size", "2.5"))
    assert argv == ["--kv-offloading-size", "2.5"]
    worker = EngineConfig(**engine_kwargs_from_args(parse("decode", *argv)))
    assert worker.kv_offloading_size == 2.5 and worker.kv_offloading_backend == "native"
    assert baton_main(["serve", "--kv-offloading-backend", "lmcache"]) == 2


def test_logprobs_mode_and_kv_scales_reach_the_workers_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``baton serve --logprobs-mode processed_logprobs --calculate-kv-scales`` (vLLM's) hands
    both to each worker; a mode vLLM does not have stops serve before it starts, naming the
    modes."""
    from baton.serve import engine_argv
    from baton_engine.config import EngineConfig

    argv = engine_argv(
        parse("serve", "--logprobs-mode", "processed_logprobs", "--calculate-kv-scales")
    )
    assert argv == ["--calculate-kv-scales", "--logprobs-mode", "processed_logprobs"]
    worker = EngineConfig(**engine_kwargs_from_args(parse("decode", *argv)))
    assert worker.logprobs_mode == "processed_logprobs" and worker.calculate_kv_scales
    with pytest.raises(SystemExit):
        parse("serve", "--logprobs-mode", "logits")
    assert "raw_logits" in capsys.readouterr().err
    with pytest.raises(InvalidRequestError, match="processed_logits"):
        EngineConfig(model="m", logprobs_mode="processed").validate()


def test_logits_processors_reach_the_workers_engines() -> None:
    """``baton serve --logits-processors A B`` (vLLM's: several class names) hands them to each
    worker, whose engine loads them."""
    from baton.serve import engine_argv
    from baton_engine.config import EngineConfig

    argv = engine_argv(parse("serve", "--logits-processors", "pkg.mod.A", "pkg.mod:B"))
    assert argv == ["--logits-processors", "pkg.mod.A", "pkg.mod:B"]
    worker = EngineConfig(**engine_kwargs_from_args(parse("decode", *argv)))
    assert worker.logits_processors == ("pkg.mod.A", "pkg.mod:B")


def test_vllms_api_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_API_KEY`` sets the key as in vLLM, when ``BATON_API_KEY`` does not."""
    monkeypatch.delenv("BATON_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert parse("serve").api_key == parse("gateway").api_key == "from-vllm"
    monkeypatch.setenv("BATON_API_KEY", "from-baton")
    assert parse("serve").api_key == "from-baton"
    assert parse("serve", "--api-key", "given").api_key == "given"


def test_a_config_file_as_vllm_reads_it(tmp_path: Path) -> None:
    """``--config FILE``: the YAML's keys are the subcommand's flags (dashes or underscores);
    the command line's own win; false is the --no- form of a flag that has one."""
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: /models/m\n"
        "port: 9000\n"
        "max_model_len: 2048\n"
        "trust-remote-code: true\n"
        "enable-prefix-caching: false\n"
        "enable-auto-tool-choice: false\n"
        "lora-modules: [a=/x, b=/y]\n"
        'override-generation-config: {"temperature": 0.5}\n'
    )
    parser = build_parser()
    argv = with_config_file(["serve", "--config", str(config), "--port", "9001"], parser)
    args = parser.parse_args(argv)
    assert (args.model_option, args.port, args.max_model_len) == ("/models/m", 9001, 2048)
    assert args.trust_remote_code and not args.enable_prefix_caching
    assert not args.enable_auto_tool_choice and args.lora_modules == ["a=/x", "b=/y"]
    assert args.override_generation_config == {"temperature": 0.5}
    assert with_config_file(["serve", "--port", "1"], parser) == ["serve", "--port", "1"]
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(InvalidRequestError, match="not a YAML mapping"):
        with_config_file(["serve", f"--config={tmp_path / 'list.yaml'}"], parser)


def test_serve_takes_one_model() -> None:
    args = parse("serve", "a", "--model", "b")
    with pytest.raises(InvalidRequestError, match="two models"):
        args.func(args)


def test_llm_takes_vllms_arguments(caplog: pytest.LogCaptureFixture) -> None:
    """``LLM(model, trust_remote_code=True, swap_space=4, ...)``: vLLM's engine arguments leave
    Baton's alone, with a note each; a value Baton cannot serve raises, naming it."""
    given: dict[str, Any] = dict(
        trust_remote_code=True,
        enable_expert_parallel=True,  # (a mixture of experts' deployment: the same outputs)
        swap_space=4,
        disable_log_stats=True,
        enforce_eager=True,
        quantization=None,
        max_model_len=64,
    )
    with caplog.at_level(logging.INFO, logger="baton_engine.vllm_flags"):
        left = take_engine_args(given)
    assert left == {"enforce_eager": True, "quantization": None, "max_model_len": 64}
    assert "trust_remote_code has no effect in Baton" in caplog.text
    assert "enable_expert_parallel has no effect in Baton" in caplog.text
    assert "disable_log_stats" not in caplog.text  # (LLM's default in vLLM too)
    for bad, message in (
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size 2"),
        ({"data_parallel_size": 2}, "LLM"),  # (one engine; serve runs several)
    ):
        with pytest.raises(InvalidRequestError, match=message):
            take_engine_args(bad)

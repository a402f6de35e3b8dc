"""``baton serve`` run with a vLLM command line: vLLM's flags that change nothing here are
accepted, and the ones Baton implements work as in vLLM: HTTPS (``--ssl-keyfile`` /
``--ssl-certfile``), ``--tokenizer``, ``--default-chat-template-kwargs``,
``--enable-force-include-usage``, ``--model`` (a repository id, from a Hugging Face cache),
``--served-model-name`` (two names); the workers' metrics under vLLM's names
(``--metric-names vllm``); ``--uds``, ``--max-logprobs``, ``--chat-template-content-format``
and ``--exclude-tools-when-tool-choice-none``; ``--logits-processors``, whose arguments requests
give in ``vllm_xargs``."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.integration
TESTS = Path(__file__).resolve().parents[1]

TEMPLATE = "{{ greeting }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A key and a certificate for 127.0.0.1, valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def served(
    serve_launcher: Any, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Path]]:
    folder = tmp_path_factory.mktemp("vllm-command-line")
    key, cert = self_signed_certificate(folder)
    # The tokenizer from its own folder, with a chat template that shows it is the one used.
    tokenizer = folder / "tokenizer"
    tokenizer.mkdir()
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, tokenizer / f.name)
    (tokenizer / "chat_template.jinja").write_text(TEMPLATE)
    # The model by repository id, from a Hugging Face cache (its files linked, as the hub
    # client links snapshots to blobs).
    repo = folder / "hub" / "models--test-org--smol"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c0ffee")
    snapshot = repo / "snapshots" / "c0ffee"
    snapshot.mkdir(parents=True)
    for f in default_model_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_CACHE", str(folder / "hub"))
        # (the workers import --logits-processors' class from the tests' folder)
        env.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        server = _start(serve_launcher, tokenizer, key, cert)
    try:
        yield server, cert
    finally:
        _, survivors = serve_launcher.stop(server)
        assert not survivors, f"left behind: {survivors}"


def _start(serve_launcher: Any, tokenizer: Path, key: Path, cert: Path) -> Any:
    return serve_launcher.start(
        [
            "--model", "test-org/smol",
            "--served-model-name", "smol", "smollm",
            "--mode", "aggregated",
            "--trust-remote-code",
            "--tensor-parallel-size", "1",
            "--enable-chunked-prefill",
            "--swap-space", "4",
            "--disable-log-requests",
            "--disable-log-stats",
            "--kv-cache-dtype", "auto",
            "--tokenizer", str(tokenizer),
            "--ssl-keyfile", str(key),
            "--ssl-certfile", str(cert),
            "--root-path", "/proxy",  # (a proxy strips it: requests come to /v1/...)
            "--enable-force-include-usage",
            "--default-chat-template-kwargs", '{"greeting": "Ahoy! "}',
            "--metric-names", "vllm",
            "--logits-processors", "example_logits_processors:TargetToken",
        ]
    )  # fmt: skip


def trusting(cert: Path) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(cert))


def test_served_over_https(served: tuple[Any, Path]) -> None:
    server, cert = served
    assert server.base_url == f"https://127.0.0.1:{server.port}/v1"
    with httpx.Client(verify=trusting(cert), timeout=60) as http:
        reply = http.get(f"{server.base_url}/models")
        assert reply.status_code == 200, reply.text
        assert [m["id"] for m in reply.json()["data"]] == ["smol", "smollm"]
        # Requests may name the model by either name; the answer names the one asked for.
        for name, status in (("smol", 200), ("smollm", 200), ("nope", 404)):
            body = {"model": name, "prompt": "Hi", "max_tokens": 2}
            reply = http.post(f"{server.base_url}/completions", json=body)
            assert reply.status_code == status, reply.text
            if status == 200:
                assert reply.json()["model"] == name
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served
        httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=10)
    with pytest.raises(httpx.ConnectError):  # nor HTTPS a client cannot verify
        httpx.get(f"https://127.0.0.1:{server.port}/v1/models", timeout=10)


def test_tokenizer_and_default_chat_template_kwargs(served: tuple[Any, Path]) -> None:
    """The prompt is rendered with --tokenizer's template and --default-chat-template-kwargs,
    which a request's own chat_template_kwargs override."""
    server, cert = served
    messages = [{"role": "user", "content": "Name a colour."}]
    root = f"https://127.0.0.1:{server.port}"
    with httpx.Client(base_url=root, verify=trusting(cert), timeout=60) as http:

        def rendered(**extra: Any) -> str:
            ids = http.post("/tokenize", json={"messages": messages, **extra}).json()["tokens"]
            text: str = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
            return text

        assert rendered() == "Ahoy! Name a colour.\n"
        assert rendered(chat_template_kwargs={"greeting": "Hi. "}) == "Hi. Name a colour.\n"
        # A request's own template is code the gateway would run: refused without
        # --trust-request-chat-template, as in vLLM.
        for path, extra in (
            ("/tokenize", {"chat_template": "{{ messages }}"}),
            ("/v1/chat/completions", {"chat_template": "{{ messages }}", "max_tokens": 2}),
            ("/tokenize", {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}),
        ):
            reply = http.post(path, json={"messages": messages, **extra})
            assert reply.status_code == 400, reply.text
            assert "--trust-request-chat-template" in reply.json()["error"]["message"]


def test_streams_end_with_usage_unasked(served: tuple[Any, Path]) -> None:
    server, cert = served
    with (
        httpx.Client(verify=trusting(cert)) as http_client,
        OpenAI(base_url=server.base_url, api_key="x", http_client=http_client) as client,
    ):
        chunks = list(
            client.chat.completions.create(
                model="smol",
                messages=[{"role": "user", "content": "Say hi."}],
                max_tokens=5,
                temperature=0,
                stream=True,
            )
        )
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.completion_tokens == 5 or chunks[-2].choices[0].finish_reason == "stop"
    assert usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])  # (only the last: not continuous usage)


def test_vllm_xargs_reach_the_custom_logits_processors(served: tuple[Any, Path]) -> None:
    """``--logits-processors``: a request's ``vllm_xargs`` reach the workers' processor (each
    token its target, chat or text); arguments it refuses are a 400 naming it; a request
    without them is served as without processors."""
    server, cert = served
    with (
        httpx.Client(verify=trusting(cert)) as http_client,
        OpenAI(base_url=server.base_url, api_key="x", http_client=http_client) as client,
    ):
        asked = {"vllm_xargs": {"target_token": 28}, "return_token_ids": True}
        text = client.completions.create(
            model="smol", prompt="Hi", max_tokens=4, temperature=0.7, seed=1, extra_body=asked
        )
        assert (text.choices[0].model_extra or {})["token_ids"] == [28] * 4
        chat = client.chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=3,
            temperature=0,
            extra_body=asked,
        )
        assert (chat.choices[0].model_extra or {})["token_ids"] == [28] * 3
        plain = client.completions.create(
            model="smol",
            prompt="Hi",
            max_tokens=4,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        assert (plain.choices[0].model_extra or {})["token_ids"] != [28] * 4
        with pytest.raises(openai.BadRequestError, match="TargetToken: target_token must be"):
            client.completions.create(
                model="smol",
                prompt="Hi",
                max_tokens=2,
                extra_body={"vllm_xargs": {"target_token": "x"}},
            )


def test_metrics_under_vllms_names(served: tuple[Any, Path]) -> None:
    """Dashboards and autoscalers built for vLLM find the engine's metrics under their names
    (the gateway's /metrics includes the workers'), with vLLM's model_name label."""
    server, cert = served
    with httpx.Client(verify=trusting(cert), timeout=60) as http:
        text = http.get(f"https://127.0.0.1:{server.port}/metrics").text
    # (the gateway adds each worker's role and address to its series)
    for name in (
        'vllm:num_requests_running{model_name="smol",role="decode"',
        'vllm:num_requests_waiting{model_name="smol",role="decode"',
        'vllm:kv_cache_usage_perc{model_name="smol",role="decode"',
        'vllm:generation_tokens_total{model_name="smol",role="decode"',
        "vllm:time_to_first_token_seconds_bucket{",
        "vllm:e2e_request_latency_seconds_count{",
        "vllm:request_success_total{",
        "vllm:request_prompt_tokens_bucket{",
        'vllm:gpu_cache_usage_perc{model_name="smol",role="decode"',  # (vLLM's older name)
        "vllm:request_generation_tokens_count{",
        # the phases of a request and the tokens of each step, which vLLM's dashboard plots
        "vllm:request_queue_time_seconds_count{",
        "vllm:request_prefill_time_seconds_count{",
        "vllm:request_decode_time_seconds_count{",
        "vllm:request_inference_time_seconds_count{",
        "vllm:request_time_per_output_token_seconds_count{",
        "vllm:request_params_max_tokens_bucket{",
        "vllm:iteration_tokens_total_bucket{",
        'vllm:cache_config_info{block_size="16",',  # (load balancers size workers by it)
    ):
        assert name in text, name
    assert "baton:num_requests_running" not in text
    assert "baton:kv_transfer_bytes_total" in text  # (Baton's own: no vLLM counterpart)


# Prints each message's content as the template receives it.
CONTENT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }};{% endfor %}{% if tools %}TOOLS{% endif %}"
)


@pytest.fixture(scope="module")
def on_socket(
    serve_launcher: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, httpx.HTTPTransport]]:
    """``baton serve --uds PATH`` with vLLM's --max-logprobs, --chat-template-content-format
    and --exclude-tools-when-tool-choice-none."""
    socket_path = tmp_path_factory.mktemp("uds") / "baton.sock"
    server = serve_launcher.start(
        [
            "--uds", str(socket_path),
            "--mode", "aggregated",
            "--max-logprobs", "2",
            "--chat-template", CONTENT_TEMPLATE,
            "--chat-template-content-format", "openai",
            "--exclude-tools-when-tool-choice-none",
            "--enable-tokenizer-info-endpoint",
        ]
    )  # fmt: skip
    try:
        yield server, httpx.HTTPTransport(uds=str(socket_path))
    finally:
        _, survivors = serve_launcher.stop(server)
        assert not survivors, f"left behind: {survivors}"


def test_served_on_a_unix_socket(on_socket: tuple[Any, httpx.HTTPTransport]) -> None:
    server, transport = on_socket
    assert server.base_url.startswith("unix:") and server.base_url.endswith("baton.sock")
    with (
        httpx.Client(transport=transport) as http_client,
        OpenAI(base_url="http://baton/v1", api_key="x", http_client=http_client) as client,
    ):
        assert [m.id for m in client.models.list().data] == [server.model]
        reply = client.completions.create(
            model=server.model, prompt="Hello", max_tokens=2, logprobs=2
        )
        assert reply.choices[0].logprobs is not None
        # --max-logprobs 2: more is vLLM's 400
        with pytest.raises(openai.BadRequestError, match=r"logprobs of 3, .* max allowed: 2"):
            client.completions.create(model=server.model, prompt="Hello", max_tokens=2, logprobs=3)
        # Without VLLM_SERVER_DEV_MODE, no POST /reset_prefix_cache (as in vLLM).
        assert http_client.post("http://baton/reset_prefix_cache").status_code == 404


def test_content_format_and_tools_reach_the_template_as_configured(
    on_socket: tuple[Any, httpx.HTTPTransport],
) -> None:
    server, transport = on_socket
    messages = [{"role": "user", "content": "Hi"}]
    with httpx.Client(transport=transport, base_url="http://baton", timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
        assert text == "[{'type': 'text', 'text': 'Hi'}];"  # (OpenAI's parts: the flag's)

        def prompt_tokens(**extra: Any) -> int:
            body = {"model": server.model, "messages": messages, "max_tokens": 1, **extra}
            reply = http.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            count: int = reply.json()["usage"]["prompt_tokens"]
            return count

        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        assert prompt_tokens(tools=[tool], tool_choice="none") == prompt_tokens() == len(ids)
        # --enable-tokenizer-info-endpoint: the tokenizer's configuration, as vLLM's
        info = http.get("/tokenizer_info").json()
        assert info["chat_template"] == CONTENT_TEMPLATE  # (the server's, which requests get)
        from baton_engine.model_files import load_model_tokenizer

        assert info["tokenizer_class"] == type(load_model_tokenizer(None)).__name__
        assert info["eos_token"] == "<|im_end|>" and "vocab_file" not in info

"""LoRA adapters on ``baton serve --enable-lora --lora-modules ...``, driven by the official
``openai`` SDK: a request names an adapter as its ``model`` (as with vLLM), the answer is the
offline engine's with that adapter (``LLM(enable_lora=True)`` + ``LoRARequest``), also when the
prompt is prefilled on the prefill worker and its KV pulled by the decode worker. Adapters load
and unload at run time (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) on every worker, a restarted one
too."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from lora_adapters import SHAPES, write_adapter

pytestmark = pytest.mark.integration

PROMPT = "Once upon a time, in a land far away, there lived a"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-adapters")
    return {
        "every": write_adapter(root / "every", rank=8, alpha=16, targets=tuple(SHAPES), seed=1),
        "mlp": write_adapter(root / "mlp", rank=8, alpha=8, targets=("down_proj",), seed=3),
        # loaded at run time
        "qv": write_adapter(root / "qv", rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=2),
    }


@pytest.fixture(scope="module")
def server(
    serve_launcher: Any, default_model_dir: Path, adapters: dict[str, Path]
) -> Iterator[Any]:
    # Disaggregated, every prompt prefilled on the prefill worker: the adapter's name travels
    # to both workers. One adapter as name=path, the other in vLLM's JSON form.
    mlp = json.dumps({"name": "mlp", "path": str(adapters["mlp"])})
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server = serve_launcher.start(
            [
                str(default_model_dir),
                "--dtype", "float32",
                "--enable-lora",
                "--max-loras", "2",
                "--max-lora-rank", "8",
                "--lora-modules", f"every={adapters['every']}", mlp,
                "--remote-prefill-threshold", "0",
            ]
        )  # fmt: skip
    yield server
    _, survivors = serve_launcher.stop(server)
    assert not survivors, f"left behind: {survivors}"


@pytest.fixture(scope="module")
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def offline(default_model_dir: Path, adapters: dict[str, Path]) -> dict[str, Any]:
    """The offline engine's greedy texts and embeddings, per adapter ("" for none)."""
    from baton import LLM, LoRARequest, SamplingParams

    llm = LLM(
        str(default_model_dir),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_model_len=512,
        kv_cache_memory=32 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out: dict[str, Any] = {}
    for i, name in enumerate(["", *adapters]):
        lora = LoRARequest(name, i, str(adapters[name])) if name else None
        (gen,) = llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)
        (emb,) = llm.embed(PROMPT, lora_request=lora, use_tqdm=False)
        out[name] = (gen.outputs[0].text, emb.outputs.embedding)
    return out


def test_models_lists_the_adapters(
    client: openai.OpenAI, server: Any, adapters: dict[str, Path], default_model_dir: Path
) -> None:
    assert server.model == str(default_model_dir)  # as vLLM names it: the path as given
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {server.model, "every", "mlp"}
    for name in ("every", "mlp"):
        path = adapters[name]
        card = cards[name].model_dump()
        assert card["parent"] == server.model and card["root"] == str(path)
        got = client.models.retrieve(name).model_dump()  # (OpenAI's retrieve)
        # each answer's cards carry its own time, as vLLM's: a second may tick between the two
        assert abs(got.pop("created") - card.pop("created")) <= 2
        assert got == card


def test_requests_run_with_their_adapter(
    client: openai.OpenAI, server: Any, offline: dict[str, Any]
) -> None:
    texts = {}
    for name in ("", "every", "mlp"):
        model = name or server.model
        response = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert response.model == model
        texts[name] = response.choices[0].text
        assert texts[name] == offline[name][0], name
    assert texts["every"] != texts[""] and texts["mlp"] != texts[""]
    # streamed: the same text, in chunks
    stream = client.completions.create(
        model="every",
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c for c in stream if c.choices]
    assert all(c.model == "every" for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == offline["every"][0]
    # every prompt went through the prefill worker
    metrics = httpx.get(f"{server.root_url}/metrics", timeout=30).text
    remote = re.search(r'baton:disagg_decisions_total\{.*decision="remote".*\} (\S+)', metrics)
    assert remote is not None and float(remote.group(1)) >= 4, metrics[-2000:]


def test_chat_and_embeddings_with_an_adapter(
    client: openai.OpenAI, offline: dict[str, Any]
) -> None:
    chat = client.chat.completions.create(
        model="mlp", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4
    )
    assert chat.model == "mlp" and chat.usage is not None and chat.usage.completion_tokens > 0
    embedded = client.embeddings.create(model="every", input=PROMPT)
    assert embedded.model == "every"
    np.testing.assert_allclose(
        np.asarray(embedded.data[0].embedding), np.asarray(offline["every"][1]), atol=2e-4
    )


def test_metrics_name_the_adapters_in_use(client: openai.OpenAI, server: Any) -> None:
    """Each worker's ``lora_requests_info`` (vLLM's, which the Gateway API Inference
    Extension's endpoint picker reads for LoRA affinity) names the adapters its running
    requests use, and drops them once they end."""

    def decode_info() -> str:
        text = httpx.get(f"{server.root_url}/metrics", timeout=30).text
        (line,) = (
            line
            for line in text.splitlines()
            if line.startswith("baton:lora_requests_info{") and 'role="decode"' in line
        )
        assert 'max_lora="2"' in line, line
        return line

    def wait_for(label: str) -> None:
        deadline = time.monotonic() + 60
        while label not in (line := decode_info()):
            assert time.monotonic() < deadline, line
            time.sleep(0.05)

    stream = client.completions.create(
        model="mlp", prompt=PROMPT, max_tokens=480, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    with stream:
        next(iter(stream))
        wait_for('running_lora_adapters="mlp"')
    wait_for('running_lora_adapters=""')  # (the closed stream cancelled the request)


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)


def test_adapters_load_and_unload_at_run_time(
    client: openai.OpenAI, server: Any, adapters: dict[str, Path], offline: dict[str, Any]
) -> None:
    http = httpx.Client(base_url=server.root_url, timeout=60)
    body = {"lora_name": "qv", "lora_path": str(adapters["qv"])}
    loaded = http.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'qv' added successfully."
    assert "qv" in {m.id for m in client.models.list().data}
    response = client.completions.create(
        model="qv", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert response.choices[0].text == offline["qv"][0]  # on the prefill and decode workers

    again = http.post("/v1/load_lora_adapter", json=body)
    assert (
        again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    )
    missing = {"lora_name": "gone", "lora_path": str(adapters["qv"]) + "-missing"}
    refused = http.post("/v1/load_lora_adapter", json=missing)
    assert refused.status_code == 400 and "no adapter_config.json" in refused.text
    assert "gone" not in {m.id for m in client.models.list().data}

    unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="qv", prompt=PROMPT, max_tokens=2)
    unknown = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
    assert unknown.status_code == 404 and "cannot be found" in unknown.text
    # loaded again under the same name: served again
    assert http.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert "qv" in {m.id for m in client.models.list().data}


def test_a_restarted_worker_gets_the_adapters_changed_at_run_time(
    client: openai.OpenAI, server: Any, offline: dict[str, Any]
) -> None:
    """``baton serve`` restarts a dead worker with its command line's ``--lora-modules``; the
    gateway loads the adapters loaded since ("qv", the test above) and unloads those unloaded
    ("mlp", here) on it before routing to it again, so requests naming "qv" keep their answer."""
    http = httpx.Client(base_url=server.root_url, timeout=60)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
    (decode,) = (
        p for p in server.descendants() if "baton.cli" in p.cmdline() and "decode" in p.cmdline()
    )
    decode.kill()
    deadline = time.monotonic() + 180
    while "decode exited with status" not in server.output(400):
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.1)
    while True:  # the restarted decode worker serves again, "qv" too
        try:
            response = client.completions.create(
                model="qv", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            break
        except openai.APIError as e:
            assert time.monotonic() < deadline, f"{e}\n{server.output(400)}"
            time.sleep(0.5)
    assert response.choices[0].text == offline["qv"][0]
    log = server.output(400)
    assert re.search(r"decode worker \S+: loaded LoRA adapter 'qv'", log), log
    assert re.search(r"decode worker \S+: unloaded LoRA adapter 'mlp'", log), log
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="mlp", prompt=PROMPT, max_tokens=2)

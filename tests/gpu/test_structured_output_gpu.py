"""Structured output with the GPU's defaults: decode CUDA graphs, async scheduling, XGrammar's
bitmask applied on the device, and multi-step scheduling (K=4) for the free requests of the same
batch. The weights are random, so every constrained token is the grammar's doing.

The model: the default one's shape with dummy weights, or ``BATON_TEST_MODEL`` (a folder from
``benchmarks/make_model_dir.py``: a tokenizer and a config) where its GGUF is not installed.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{2}-[0-9]{3}"


def _model() -> str:
    from baton_engine.errors import ModelLoadError
    from baton_engine.model_files import default_model_path

    folder = os.environ.get("BATON_TEST_MODEL")
    if folder:
        return folder
    try:
        return str(default_model_path())
    except ModelLoadError as e:
        pytest.skip(f"{e}; or set BATON_TEST_MODEL (benchmarks/make_model_dir.py makes one)")


def test_outputs_follow_their_grammars_on_the_gpu() -> None:
    from baton import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM(
        _model(),
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_model_len=512,
        gpu_memory_utilization=0.3,
        num_scheduler_steps=4,
    )
    core = llm.engine.core
    assert core.async_scheduling and core.runner.graphs is not None
    person = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    code = StructuredOutputsParams(regex=CODE)
    choice = StructuredOutputsParams(choice=["yes", "no", "it depends"])
    constrained = [
        SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=80, structured_outputs=so)
        for so in (person, code, choice)
        for t, p, s in ((0.0, 1.0, None), (1.0, 1.0, 1), (1.0, 0.9, 2), (0.7, 1.0, 3))
    ]
    free = [
        SamplingParams(temperature=t, seed=s, max_tokens=64, ignore_eos=True)
        for t, s in ((0.0, None), (1.0, 4)) * 4
    ]
    prompts = [f"Request {i}:" for i in range(len(constrained) + len(free))]
    outs = llm.generate(prompts, constrained + free, use_tqdm=False)
    for out, params in zip(outs, constrained, strict=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        so = params.structured_outputs
        assert so is not None
        if so is person:
            value = json.loads(completion.text)
            assert set(value) == {"name", "age", "city"} and len(value["name"]) <= 8
            assert 0 <= value["age"] <= 120 and value["city"] in ("Paris", "Rome", "Oslo")
        elif so is code:
            assert re.fullmatch(CODE, completion.text), completion.text
        else:
            assert completion.text in ("yes", "no", "it depends")
    for out in outs[len(constrained) :]:
        assert len(out.outputs[0].token_ids) == 64
    # the free requests ran several passes a step once the constrained ones had ended
    assert core.scheduler.num_multi_steps > 0
    core.check_invariants()

"""Beam search offline (``LLM.beam_search``), as vLLM runs it: each prompt's ``beam_width``
best beams, ranked by length-normalized cumulative logprob; every beam's cumulative logprob is
what transformers gives its tokens; one beam is greedy decoding; beams end at EOS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import build_model

from baton import LLM, BeamSearchParams, SamplingParams
from baton_engine.beam_search import score
from baton_engine.errors import InvalidRequestError

PROMPTS = ["The quick brown fox", "Once upon a time"]


@pytest.fixture(scope="module")
def tiny(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp("tiny-llama")
    hf = build_model("llama", default_model_dir, folder)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    return llm, hf


def hf_logprob(hf: Any, prompt: list[int], generated: list[int]) -> float:
    """log P(generated | prompt) by transformers."""
    ids = torch.tensor([prompt + generated])
    with torch.inference_mode():
        logp = hf(ids).logits[0].float().log_softmax(-1)
    return float(sum(logp[len(prompt) - 1 + i, t] for i, t in enumerate(generated)))


def test_beams_are_ranked_and_scored_as_transformers_scores_them(tiny: Any) -> None:
    llm, hf = tiny
    params = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    outs = llm.beam_search(PROMPTS, params)
    tok = llm.get_tokenizer()
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = tok(prompt).input_ids
        beams = out.sequences
        assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
        scores = [score(b, (), 1.0) for b in beams]
        assert scores == sorted(scores, reverse=True)
        for beam in beams:
            generated = beam.tokens[len(ids) :]
            assert beam.tokens[: len(ids)] == ids and len(generated) == 5
            assert beam.finish_reason == "length" and len(beam.logprobs) == 5
            assert beam.cum_logprob == pytest.approx(hf_logprob(hf, ids, generated), abs=1e-3)
            assert beam.text == tok.decode(generated, skip_special_tokens=True)


def test_one_beam_is_greedy_decoding(tiny: Any) -> None:
    llm, _ = tiny
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    (want,) = llm.generate(PROMPTS[0], greedy, use_tqdm=False)
    (got,) = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=1, max_tokens=6))
    (beam,) = got.sequences
    assert beam.tokens[-6:] == want.outputs[0].token_ids
    assert beam.cum_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)


def test_beams_end_at_eos_and_bad_parameters(default_model_dir: Path) -> None:
    llm = LLM(str(default_model_dir), max_model_len=128, kv_cache_memory=16 << 20)
    tok = llm.get_tokenizer()
    # An answer the model has just finished: its end-of-turn token is the likeliest next one.
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
    )
    (out,) = llm.beam_search(
        {"prompt_token_ids": tok(chat + "The answer is 4.", add_special_tokens=False).input_ids},
        BeamSearchParams(beam_width=2, max_tokens=4),
    )
    stopped = [b for b in out.sequences if b.finish_reason == "stop"]
    assert stopped, [b.text for b in out.sequences]
    eos = set(llm.engine.core.model_config.eos_token_ids)
    for beam in stopped:
        assert beam.tokens[-1] in eos and beam.text == ""  # (the EOS alone, left out)
    assert out.sequences[0] is stopped[0]  # (the best: a short, likely ending)
    with pytest.raises(InvalidRequestError, match="beam_width must be at most 10"):
        llm.beam_search("Hi", BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def test_extreme_length_penalties_score_without_failing() -> None:
    """A length_penalty whose power of the length overflows (or underflows) a float scores
    every beam the same (or by its sign) instead of raising (an HTTP request's 500 before)."""
    from baton_engine.beam_search import BeamSearchSequence

    beam = BeamSearchSequence(tokens=[1, 2, 3], cum_logprob=-2.0)
    assert score(beam, (), 2.0) == -2.0 / 9
    assert score(beam, (), 1e308) == 0.0
    assert score(beam, (), -1e308) == float("-inf")
    assert score(BeamSearchSequence(tokens=[1, 2], cum_logprob=0.0), (), -1e308) == 0.0

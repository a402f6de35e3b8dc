"""Structured output: requests whose tokens must follow a JSON schema, a regular expression, a
list of choices or an EBNF grammar, through XGrammar (vLLM's default backend).

Each such request carries a ``Grammar``: XGrammar's matcher over the compiled grammar, which
accepts every token the request samples. Before a step samples it, the engine fills the
request's row of a token bitmask (1 bit a token: may come next); the sampler sets the others'
logits to ``-inf`` before anything else. When the grammar is complete, the stop tokens are all
it allows; the request ends when its matcher terminates (with EOS, as any other end).

A request with a grammar needs its previous token accepted before its next mask is known: it
never runs a step ahead of its tokens (async scheduling waits for them) nor several passes a
step (multi-step scheduling).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from baton_engine.errors import InvalidRequestError
from baton_engine.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Compiled grammars kept for requests that send the same schema again (vLLM's default size);
# without a limit a server seeing ever new schemas would grow without bound.
_CACHE_LIMIT_BYTES = 512 << 20


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher
        # A token the grammar forbids was sampled (the bitmask should make it impossible):
        # the request ends there rather than go on outside its grammar.
        self.refused = False

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (``refused`` set, nothing else changed) when the
        grammar forbids it."""
        if self._matcher.accept_token(token_id):
            return True
        logger.error(
            "structured output: token %d is not allowed here; ending the request", token_id
        )
        self.refused = True
        return False

    @property
    def is_ended(self) -> bool:
        """Complete (its stop token accepted), or a token was refused: nothing may follow."""
        return self.refused or bool(self._matcher.is_terminated())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Set ``bitmask[row]`` to the tokens that may come next."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the grammar allows in a row from here; its position
        is left unchanged."""
        n = 0
        for token_id in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, tokens: Sequence[int]) -> None:
        """Set rows ``row``, ``row + 1``, ... ``row + len(tokens)`` of ``bitmask`` to the
        tokens that may come next here and after each of ``tokens`` (drafts the grammar
        allows: ``valid_prefix``); its position is left unchanged."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        for i, token_id in enumerate(tokens):
            if not self._matcher.accept_token(token_id):
                raise ValueError(f"draft token {token_id} is not allowed by the grammar")
            self._matcher.fill_next_token_bitmask(bitmask, row + 1 + i)
        if tokens:
            self._matcher.rollback(len(tokens))


class StructuredOutputManager:
    """Compiles requests' grammars for one model's tokenizer and fills their bitmasks.

    ``load_tokenizer`` is called at the first request with a grammar (most engines never see
    one); compiled grammars are cached by XGrammar, so a schema sent again is not recompiled.
    XGrammar's compiler may be called from several threads at once (a worker validates
    requests on its gRPC threads, then adds them on its engine loop: the loop gets the
    cached result).
    """

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size  # the model's: the logits' width
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                try:
                    tokenizer = self._load_tokenizer()
                except Exception as e:
                    raise InvalidRequestError(
                        f"structured output needs the model's tokenizer, which is missing: {e}"
                    ) from e
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=_CACHE_LIMIT_BYTES
                )
            return self._compiler

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher of ``params``' grammar; ``InvalidRequestError`` names what is wrong
        with a schema, pattern or grammar XGrammar cannot compile."""
        import xgrammar as xgr

        compiler = self._get_compiler()
        kind, spec = params.kind
        try:
            if params.reasoning_end is not None:
                compiled = compiler.compile_grammar(_after_reasoning(params))
            elif kind == "json":
                compiled = compiler.compile_json_schema(
                    spec if isinstance(spec, str) else json.dumps(spec),
                    any_whitespace=not params.disable_any_whitespace,
                )
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(spec)
            elif kind == "choice":
                # a regular expression of the escaped alternatives (as vLLM does)
                compiled = compiler.compile_regex("|".join(_escape_regex(c) for c in spec))
            elif kind == "structural_tag":
                compiled = compiler.compile_grammar(_structural_tag(spec))
            else:
                compiled = compiler.compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError(f"invalid structured output {kind}: {_first_line(e)}") from e
        return Grammar(xgr.GrammarMatcher(compiled))

    def bitmask(
        self, grammars: Sequence[Grammar], drafts: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """``[N, ceil(V / 32)]`` int32 on the CPU: the tokens each grammar allows next, a row
        each; with ``drafts`` (speculative decoding: each grammar's, possibly none), after each
        of its drafts too, in the rows that follow its own (N = len(grammars) + all drafts)."""
        import xgrammar as xgr

        if drafts is None:
            mask: torch.Tensor = xgr.allocate_token_bitmask(len(grammars), self.vocab_size)
            for i, g in enumerate(grammars):
                g.fill_bitmask(mask, i)
            return mask
        num_rows = len(grammars) + sum(len(d) for d in drafts)
        mask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        row = 0
        for g, ahead in zip(grammars, drafts, strict=True):
            g.fill_bitmasks(mask, row, ahead)
            row += 1 + len(ahead)
        return mask


def _after_reasoning(params: StructuredOutputsParams) -> Any:
    """The grammar of free text up to and including the first ``params.reasoning_end``, up to
    4 whitespace characters, then ``params``' constraint."""
    import xgrammar as xgr

    kind, spec = params.kind
    if kind == "json":
        text = spec if isinstance(spec, str) else json.dumps(spec)
        then = xgr.Grammar.from_json_schema(text, any_whitespace=not params.disable_any_whitespace)
    elif kind == "json_object":
        then = xgr.Grammar.builtin_json_grammar()
    elif kind == "regex":
        then = xgr.Grammar.from_regex(spec)
    elif kind == "choice":
        then = xgr.Grammar.from_regex("|".join(_escape_regex(c) for c in spec))
    elif kind == "structural_tag":
        then = _structural_tag(spec)
    else:
        then = xgr.Grammar.from_ebnf(spec)
    reasoning = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "",
            "content": {"type": "any_text"},
            "end": params.reasoning_end,
        },
    }
    return xgr.Grammar.concat(
        xgr.Grammar.from_structural_tag(json.dumps(reasoning)),
        xgr.Grammar.from_regex(r"[ \t\r\n]{0,4}"),
        then,
    )


def _structural_tag(spec: str | dict[str, Any]) -> Any:
    """XGrammar's grammar of a structural tag (vLLM's rule): the older ``{"structures": [...],
    "triggers": [...]}`` through XGrammar's tags-and-triggers form, anything else as its
    current ``{"type": "structural_tag", "format": ...}``."""
    import xgrammar as xgr

    tag = json.loads(spec) if isinstance(spec, str) else spec
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    if "structures" not in tag:
        return xgr.Grammar.from_structural_tag(json.dumps(tag))
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return xgr.Grammar.from_structural_tag(items, tag.get("triggers", []))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set ``logits[i, t]`` to ``-inf`` for each row ``i`` of ``rows`` where bit ``t`` of
    ``bitmask[i]`` is 0, in place (``bitmask`` ``[B, ceil(V / 32)]`` int32 on the logits'
    device). The other rows are not touched (on a 2-core CPU a row of 49,152 logits took
    ~0.12 ms: benchmarks/bench_structured_output.py)."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=list(rows))


_REGEX_SPECIAL = set("\\^$.|?*+()[]{}")
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[21:50:55] /x/y.cc:94: "


def _escape_regex(text: str) -> str:
    """``text`` as a literal in XGrammar's regular expressions."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _first_line(e: Exception) -> str:
    """XGrammar's message without its time and source-location prefix."""
    lines = str(e).strip().splitlines()
    return _LOCATION.sub("", lines[0]) if lines else type(e).__name__

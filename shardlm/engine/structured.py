"""Structured output: a grammar masks the tokens that cannot continue a valid answer.

A request names what its answer must be: a JSON schema, any JSON object, a regular expression,
one of a list of strings, or a Lark grammar (vLLM's ``StructuredOutputsParams``). The grammar
engine is llguidance (https://github.com/guidance-ai/llguidance): Rust, on the CPU, so the ranks
that sample (the last pipeline stage's) compute the mask between the forward pass and the draw,
without a GPU kernel. Chosen over xgrammar because xgrammar pins torch and ships CUDA kernels this
engine would not use; the mask's cost per token is measured by ``benchmarks/structured.py``
(figures: docs/performance.md).

The front end compiles and checks a request's grammar once (``check_grammar``: a bad schema or
regex is refused before any rank sees it); each sampling rank then keeps a matcher per sequence
(``Guide``), advanced by every token the sequence keeps, whose mask sets every other token's
logit to -inf before sampling. EOS is allowed only where the grammar may end.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from shardlm.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """What the answer must be (vLLM's names; exactly one of them)."""

    json: dict | str | None = None
    """A JSON schema (a dict, or its JSON text): the answer is JSON that validates against it."""
    regex: str | None = None
    """The answer matches this regular expression, whole."""
    choice: tuple[str, ...] | None = None
    """The answer is one of these strings."""
    grammar: str | None = None
    """A context-free grammar in Lark syntax (llguidance's dialect)."""
    json_object: bool = False
    """The answer is a JSON object (any)."""

    def __post_init__(self) -> None:
        given = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise UsageError(
                f"structured outputs need exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(given) or 'none'}"
            )
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise UsageError(f"choice={self.choice!r} must be a non-empty list of strings, e.g. ['yes', 'no']")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise UsageError(f"the JSON schema is not valid JSON ({e}); give a schema object") from None

    def spec(self) -> str:
        """The grammar in llguidance's serialized form."""
        from llguidance import LLMatcher

        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(self.json)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in self.choice))
        assert self.grammar is not None
        return LLMatcher.grammar_from_lark(self.grammar)


@lru_cache(maxsize=4)
def grammar_tokenizer(tokenizer, vocab_size: int):
    """llguidance's view of the model's vocabulary (built once per tokenizer, ~0.2 s): token
    bytes from its tokenizer.json, the logits' width and the EOS ids."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids))


def check_grammar(params: StructuredOutputsParams, tokenizer, vocab_size: int) -> None:
    """Refuse a grammar llguidance cannot compile, with a UsageError that says why."""
    try:
        spec = params.spec()
    except Exception as e:  # llguidance refuses some schemas while converting
        raise UsageError(f"the structured output spec is refused: {e}") from None
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(spec, grammar_tokenizer(tokenizer, vocab_size))
    if error:
        raise UsageError(f"the structured output spec is refused: {' '.join(error.split())[:300]}")


class Guide:
    """One sequence's grammar state on a sampling rank."""

    def __init__(self, params: StructuredOutputsParams, tokenizer, vocab_size: int, tokens: list[int]):
        import llguidance.torch as llt
        from llguidance import LLMatcher

        lltok = grammar_tokenizer(tokenizer, vocab_size)
        self.matcher: Any = LLMatcher(lltok, params.spec())
        self.bitmask = llt.allocate_token_bitmask(1, lltok.vocab_size)
        for t in tokens:  # generated before this rank held a guide (a handed-off sequence)
            self.advance(t)

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits [vocab] of tokens the grammar does not allow next to -inf, in place."""
        import llguidance.torch as llt

        llt.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        llt.apply_token_bitmask_inplace(logits.unsqueeze(0), self.bitmask)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(token)

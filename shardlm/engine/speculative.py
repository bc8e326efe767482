"""Speculative decoding: the config, n-gram (prompt lookup) drafts, and the verifier.

A decoding sequence whose recent tokens occurred before in its own history (a document it
is asked about, code it edits, a list it repeats) is likely to continue as it did then. The
proposer finds the latest earlier occurrence of the sequence's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``) and drafts the up to k tokens that
followed it (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method). The step then
feeds the last token and the k drafts together, one forward over k + 1 positions, which costs
about one token's forward while decoding is bound by reading the weights; the target model's
logits at those positions verify the drafts.

Verification keeps the output distribution exact (Leviathan et al. 2023,
https://arxiv.org/abs/2211.17192; Chen et al. 2023, https://arxiv.org/abs/2302.01318). Greedy:
drafts are accepted while each equals the target's argmax, then the target's own token follows,
so the tokens are those of plain greedy decoding. Sampling: an n-gram draft is one token with
probability 1, so draft x is accepted with probability p(x) (p: the target's distribution after
temperature, top-k and top-p), and on rejection the token is drawn from p with x removed; every
token is then distributed as p, whatever the drafts were. A draft model's draft x comes with the
distribution q it was drawn from: x is accepted with probability min(1, p(x) / q(x)), and on
rejection the token is drawn from norm(max(0, p - q)) (Leviathan et al., algorithm 1); the
n-gram case is q one-hot on x. Draft models themselves (``method`` 'draft_model' and
'layer_skip') live in draft.py.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from shardlm.engine.sampling import SamplingParams, greedy_tokens, probabilities
from shardlm.errors import UsageError

METHODS = ("ngram", "draft_model", "layer_skip")
"""n-gram lookup in the sequence's history; a small model with the target's vocabulary (vLLM's
'draft_model', given by ``model``); the target's own first ``num_layers`` layers (self-draft)."""
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "num_layers")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config``: n-gram drafts, a draft model, or a layer-skip self-draft."""

    method: str | None = None
    """One of ``METHODS``; default 'draft_model' when ``model`` is given, else 'ngram'."""
    num_speculative_tokens: int = 4
    """Most draft tokens verified per sequence and step (k)."""
    prompt_lookup_max: int = 4
    """ngram: longest suffix n-gram looked up in the sequence's history."""
    prompt_lookup_min: int = 1
    """ngram: shortest suffix n-gram that may propose a draft."""
    model: str | None = None
    """draft_model: the draft (a HF directory, a .gguf file or 'smollm2'), with the target's vocabulary."""
    num_layers: int | None = None
    """layer_skip: the target's first this many decoder layers, then its final norm and LM head, draft."""

    def __post_init__(self) -> None:
        method = self.method if self.method is not None else "draft_model" if self.model is not None else "ngram"
        object.__setattr__(self, "method", method)  # frozen: settled once, here
        if method not in METHODS:
            raise UsageError(
                f"speculative method={method!r} is not supported; use one of {METHODS} "
                "(drafts looked up in the sequence's own history, a small draft model, or the target's first layers)"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"speculative {name}={v!r} must be a positive integer")
        if method != "ngram" and (self.prompt_lookup_max, self.prompt_lookup_min) != (4, 1):
            raise UsageError(f"speculative prompt_lookup_max/min apply to method='ngram', not {method!r}; drop them")
        if (method == "draft_model") != (self.model is not None):
            raise UsageError(
                f"speculative model={self.model!r} goes with method='draft_model' (and it needs one), "
                f"not method={method!r}; give both or neither"
            )
        if method == "layer_skip":
            n = self.num_layers
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise UsageError(
                    f"speculative num_layers={n!r} must be a positive integer with method='layer_skip' "
                    "(the target's first layers that draft), e.g. 4"
                )
        elif self.num_layers is not None:
            raise UsageError(
                f"speculative num_layers={self.num_layers!r} goes with method='layer_skip', not {method!r}; drop it"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise UsageError(
                f"speculative prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                f"{self.prompt_lookup_max}; use min <= max, e.g. 1 and 4"
            )

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict form ({"method": "ngram", "num_speculative_tokens": 4, ...})."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise UsageError(
                f"speculative_config={value!r} must be a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4}'
            )
        unknown = set(value) - set(KEYS)
        if unknown:
            raise UsageError(f"speculative_config has unknown keys {sorted(unknown)}; known: {', '.join(KEYS)}")
        return cls(**value)

    @property
    def drafts_with_model(self) -> bool:
        """Drafts come from a model run on the sampling ranks (draft.py), not from the scheduler's lookup."""
        return self.method != "ngram"


def propose(tokens: list[int], config: SpeculativeConfig, limit: int) -> list[int]:
    """Up to ``min(k, limit)`` draft tokens to follow ``tokens``: what followed the latest earlier
    occurrence of its longest suffix n-gram (none found: no draft)."""
    k = min(config.num_speculative_tokens, limit)
    if k < 1 or len(tokens) < config.prompt_lookup_min + 1:
        return []
    # search the history as bytes (4 per token): the C substring search instead of a Python loop
    history = array("i", tokens).tobytes()
    for n in range(min(config.prompt_lookup_max, len(tokens) - 1), config.prompt_lookup_min - 1, -1):
        suffix = history[-4 * n :]
        end = 4 * (len(tokens) - 1)  # within the tokens before the last: an earlier occurrence, a token after it
        while (at := history.rfind(suffix, 0, end)) >= 0:
            if at % 4 == 0:  # aligned to a token, not straddling two
                return tokens[at // 4 + n : at // 4 + n + k]
            end = at + len(suffix) - 1  # the next occurrence to the left
    return []


def verify(
    logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator, q: torch.Tensor | None = None
) -> list[int]:
    """The tokens a step emits for one sequence: logits [len(drafts) + 1, vocab] at the last token
    and at each draft. Returns the accepted drafts, then one token of the target's own (the
    correction at the first rejection, or the next token after the last draft). ``q``
    [len(drafts), vocab]: the distributions a draft model drew the drafts from (None: each draft
    certain, as n-gram drafts are)."""
    if params.greedy:
        best = greedy_tokens(logits)  # first of ties, as the sampler's
        n = next((i for i, d in enumerate(drafts) if best[i] != d), len(drafts))
        return drafts[:n] + [best[n]]
    out = []
    for i, d in enumerate(drafts):
        p = probabilities(logits[i], params)
        if q is None:
            if torch.rand((), generator=generator).item() < p[d].item():
                out.append(d)
                continue
            p[d] = 0.0  # rejected: draw from what is left of p, renormalised
            return out + [int(torch.multinomial(p / p.sum(), 1, generator=generator).item())]
        # accept with probability min(1, p(d) / q(d)): u * q(d) < p(d) for u uniform in [0, 1)
        if torch.rand((), generator=generator).item() * q[i, d].item() < p[d].item():
            out.append(d)
            continue
        rest = (p - q[i].float()).clamp_(min=0.0)  # rejected: draw from norm(max(0, p - q))
        rest = rest if rest.sum() > 0 else p  # p == q up to rounding: a rejection is then (almost) impossible
        return out + [int(torch.multinomial(rest / rest.sum(), 1, generator=generator).item())]
    p = probabilities(logits[len(drafts)], params)
    return out + [int(torch.multinomial(p, 1, generator=generator).item())]

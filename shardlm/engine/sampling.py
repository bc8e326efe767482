"""Sampling parameters, the logits processors and the sampler.

Every rank of a replica samples from the same gathered logits with the same
per-sequence generator, so every rank picks the same token without another
collective (the engine is SPMD). The order is vLLM's: first the processors that
change which token is most likely (``process``: ``logit_bias``, ``min_tokens``, then the
repetition, frequency and presence penalties), then greedy is argmax; otherwise
temperature, ``min_p``, top-k, then top-p (Holtzman et al. 2019,
https://arxiv.org/abs/1904.09751), then a draw with the sequence's own ``torch.Generator``.

Logprobs (``logprobs``) are those of the model's own distribution, ``log_softmax`` of the
raw logits before any processor (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from shardlm.engine.structured import StructuredOutputsParams
from shardlm.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    n: int = 1
    """Completions of each prompt, each with its own seed stream; the prompt is computed once."""
    best_of: int | None = None
    """Generate this many (>= n) and return the n with the highest cumulative logprob (OpenAI's)."""
    max_tokens: int = 16
    """Most new tokens to generate (the CLI's --max-new-tokens; vLLM's default of 16)."""
    temperature: float = 1.0
    """0 is greedy (argmax); higher values flatten the distribution (vLLM's default of 1: sampling)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 keeps all)."""
    seed: int | None = None
    """Seed of this request's generator; None derives one from the LLM's seed and the request index."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one (after temperature; 0 keeps all)."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI's; in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time the output already holds it (OpenAI's; in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output: a positive logit divided by it, a negative one
    multiplied (Keskar et al. 2019, CTRL; 1 turns it off, > 1 discourages repeats)."""
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    """Added to these token ids' logits before sampling (OpenAI's; in [-100, 100])."""
    min_tokens: int = 0
    """End-of-sequence and stop tokens are masked until this many tokens are generated."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (for benchmarks)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the sequence."""
    stop: tuple[str, ...] = ()
    """Strings that end the sequence (a string or several); the text is cut before the first one."""
    structured_outputs: StructuredOutputsParams | None = None
    """The answer must follow this JSON schema, regex, choice or grammar (structured.py)."""
    logprobs: int | None = None
    """Return the log-probability of each generated token and of the ``logprobs`` most likely
    tokens at its position (0: the generated token's only; None: none)."""
    prompt_logprobs: int | None = None
    """The same for each prompt token after the first (the prompt is then computed whole: not
    taken from the prefix cache)."""

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
            raise UsageError(f"stop={self.stop!r} must be a string or a list of strings, e.g. ['\\n\\n']")
        object.__setattr__(self, "stop", tuple(x for x in stop if x))  # frozen: normalised once, here
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", {int(k): v for k, v in dict(self.logit_bias).items()})
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise UsageError(f"n={self.n!r} must be a positive integer (completions per prompt), e.g. 4")
        if self.best_of is not None and (not _count(self.best_of) or self.best_of < self.n):
            raise UsageError(f"best_of={self.best_of!r} must be an integer >= n={self.n}, e.g. {self.n + 2}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                raise UsageError(f"{name}={v!r} must be a number")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UsageError(f"max_tokens={self.max_tokens!r} must be a positive integer, e.g. 64")
        if not self.temperature >= 0:  # also rejects NaN
            raise UsageError(f"temperature={self.temperature!r} must be >= 0 (0 is greedy), e.g. 0.7")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p={self.top_p!r} must be in (0, 1], e.g. 0.9 (1 turns it off)")
        for name in ("top_k", "min_tokens"):
            v = getattr(self, name)
            if not _count(v):
                raise UsageError(f"{name}={v!r} must be a non-negative integer (0 turns it off), e.g. 50")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _count(v):
                raise UsageError(f"{name}={v!r} must be a non-negative integer or None, e.g. 5")
        if not 0 <= self.min_p <= 1:
            raise UsageError(f"min_p={self.min_p!r} must be in [0, 1], e.g. 0.05 (0 turns it off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise UsageError(f"{name}={getattr(self, name)!r} must be in [-2, 2] (OpenAI's range), e.g. 0.5")
        if not self.repetition_penalty > 0:
            raise UsageError(f"repetition_penalty={self.repetition_penalty!r} must be > 0 (1 turns it off), e.g. 1.1")
        if not isinstance(self.logit_bias, Mapping):
            raise UsageError(f"logit_bias={self.logit_bias!r} must map token ids to biases, e.g. {{50256: -100}}")
        for token, bias in self.logit_bias.items():
            if not _count(token):
                raise UsageError(f"logit_bias token id {token!r} must be a non-negative integer")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise UsageError(f"logit_bias[{token}]={bias!r} must be a number in [-100, 100] (OpenAI's range)")

    @property
    def generated(self) -> int:
        """Completions generated per prompt (best_of, else n)."""
        return self.best_of or self.n

    def for_engine(self) -> SamplingParams:
        """With best_of, what each generated completion needs: its cumulative logprob (logprobs >= 0)."""
        if self.generated == self.n or self.logprobs is not None:
            return self
        return dataclasses.replace(self, logprobs=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies: they depend on the tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def processes(p: SamplingParams) -> bool:
    """Whether ``process`` (or a grammar) changes this sequence's logits at all (most requests: no)."""
    return bool(p.logit_bias or p.min_tokens or p.penalized or p.structured_outputs)


def process(
    logits: torch.Tensor,
    p: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    stop_ids: frozenset[int],
) -> torch.Tensor:
    """One sequence's logits row [vocab] after ``logit_bias``, ``min_tokens`` (its ``stop_ids``
    masked while the output is shorter) and the penalties, in vLLM's order. The formulas:
    repetition: l / r where l > 0 else l * r, on tokens of the prompt or output; then
    l - frequency * count - presence * (count > 0), with count the token's occurrences in the output."""
    out = logits.float().clone()
    vocab = out.numel()
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if t < vocab], dtype=torch.long)
        out[ids] += torch.tensor([p.logit_bias[t] for t in ids.tolist()])
    if len(output_ids) < p.min_tokens and stop_ids:
        out[torch.tensor(sorted(t for t in stop_ids if t < vocab), dtype=torch.long)] = float("-inf")
    if p.penalized:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.long), minlength=vocab)[:vocab]
        if p.repetition_penalty != 1:
            seen = counts > 0
            seen[torch.tensor(list(prompt_ids), dtype=torch.long)] = True
            r = p.repetition_penalty
            out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
        out -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, its rank (1: the most likely), and the ``k`` most
    likely tokens at its position with theirs, most likely first."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]


def logprobs_of(logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """``token``'s entry from the raw logits row [vocab] it was sampled at."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp[token]
    top = torch.topk(lp, k) if k else None
    return TokenLogprob(
        float(chosen),
        int((lp > chosen).sum()) + 1,
        tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else (),
    )


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of ties). CPU float32 rows go through numpy, whose argmax is
    vectorised and much faster over a vocabulary of logits than torch's (docs/performance.md)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [seqs, vocab], already ``process``ed. Returns one token id per sequence."""
    tokens = greedy_tokens(logits)
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = int(torch.multinomial(probabilities(logits[i], p), 1, generator=generators[i]).item())
    return tokens


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from: logits [vocab] after temperature, min_p, top-k, top-p."""
    scores = logits.float() / p.temperature
    if p.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (sorted_p.cumsum(0) - sorted_p) >= p.top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs

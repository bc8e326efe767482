"""Sampling parameters and the sampler.

Every rank of a replica samples from the same gathered logits with the same
per-sequence generator, so every rank picks the same token without another
collective (the engine is SPMD). Greedy is argmax; otherwise temperature, then
top-k, then top-p (Holtzman et al. 2019, https://arxiv.org/abs/1904.09751), then
a draw with the sequence's own ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 64
    """Most new tokens to generate (the CLI's --max-new-tokens)."""
    temperature: float = 0.0
    """0 is greedy (argmax); higher values flatten the distribution."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p (1 keeps all)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 keeps all)."""
    seed: int | None = None
    """Seed of this request's generator; None derives one from the LLM's seed and the request index."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (for benchmarks)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end the sequence."""

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UsageError(f"{name}={v!r} must be a number")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UsageError(f"max_tokens={self.max_tokens!r} must be a positive integer, e.g. 64")
        if not self.temperature >= 0:  # also rejects NaN
            raise UsageError(f"temperature={self.temperature!r} must be >= 0 (0 is greedy), e.g. 0.7")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p={self.top_p!r} must be in (0, 1], e.g. 0.9 (1 turns it off)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise UsageError(f"top_k={self.top_k!r} must be a non-negative integer (0 turns it off), e.g. 50")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """logits: [seqs, vocab]. Returns one token id per sequence."""
    tokens = logits.max(dim=-1).indices.tolist()  # argmax (first of ties), at twice argmax's speed on CPU
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = int(torch.multinomial(probabilities(logits[i], p), 1, generator=generators[i]).item())
    return tokens


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from: logits [vocab] after temperature, top-k, top-p."""
    scores = logits.float() / p.temperature
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

"""Cross-entropy over logits split by vocabulary across the tp ranks (Megatron-LM's vocab-parallel
cross-entropy, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053 §3): no rank ever holds a
whole row of logits; three all-reduces of one number per token (the row max, the sum of
exponentials, the target's logit) give every rank the exact loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardlm.parallel.comm import all_reduce

IGNORE_INDEX = -100
"""A target that counts for nothing (padding), as in torch's and HF's cross-entropy."""


class _VocabParallelCE(torch.autograd.Function):
    """forward: per-token loss from local logits; backward: softmax - one-hot on the local slice."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_start: int, group) -> Tensor:
        logits = logits.float()  # [tokens, local vocab]
        row_max = all_reduce(logits.max(-1).values, group, op="max")  # [tokens]
        exp = (logits - row_max[:, None]).exp_()
        sum_exp = all_reduce(exp.sum(-1), group)  # [tokens]
        local = targets - vocab_start
        mine = (local >= 0) & (local < logits.shape[-1]) & (targets != IGNORE_INDEX)
        local = local.masked_fill(~mine, 0)
        target_logit = logits.gather(1, local[:, None])[:, 0].masked_fill(~mine, 0.0)
        target_logit = all_reduce(target_logit, group) - row_max  # each target lives on one rank
        loss = (sum_exp.log() - target_logit).masked_fill(targets == IGNORE_INDEX, 0.0)
        softmax = exp.div_(sum_exp[:, None])
        ctx.save_for_backward(softmax, local, mine, targets != IGNORE_INDEX)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        softmax, local, mine, counted = ctx.saved_tensors
        g = softmax  # d loss / d logits = softmax - one_hot(target), zero for ignored tokens
        g[torch.arange(len(local), device=g.device), local] -= mine.to(g.dtype)
        g.mul_((grad * counted)[:, None])
        return g, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets: Tensor, vocab_start: int, group) -> Tensor:
    """Per-token loss [tokens] (0 where the target is IGNORE_INDEX) from this rank's logits
    [tokens, local vocab], which hold vocabulary ids [vocab_start, vocab_start + local vocab)."""
    return _VocabParallelCE.apply(logits, targets, vocab_start, group)

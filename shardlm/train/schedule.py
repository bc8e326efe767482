"""The 1F1B pipeline schedule (PipeDream-Flush; Narayanan et al. 2021, "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", https://arxiv.org/abs/2104.04473 §2.2).

Stage s of p runs min(p - 1 - s, m) forward passes to fill the pipeline, then alternates one
forward and one backward, then drains the remaining backwards; a stage never holds the
activations of more than p - s micro-batches (GPipe holds all m), and the bubble is
(p - 1) / (m + p - 1) of the step, as for GPipe. With one stage it is forward, backward,
forward, backward: plain gradient accumulation.

Between stages travel the hidden state and the residual stream (forward) and their gradients
(backward), point to point on the pp group (``StageLinks``, as inference's pipeline uses them):
sends are asynchronous, receives block.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from shardlm.parallel.comm import recv
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.pipeline import StageLinks


def one_f_one_b(
    stage: int, stages: int, micro_batches: int, forward: Callable[[int], None], backward: Callable[[int], None]
) -> None:
    """Call forward(i) and backward(i) for i in range(micro_batches) in 1F1B order for ``stage``."""
    warmup = min(stages - 1 - stage, micro_batches)
    for i in range(warmup):
        forward(i)
    for i in range(micro_batches - warmup):
        forward(warmup + i)
        backward(i)
    for i in range(micro_batches - warmup, micro_batches):
        backward(i)


class StageIO(StageLinks):
    """A stage's activations in flight: what it received (to send back its gradient) and what it
    produced (to run backward from)."""

    def __init__(self, dims: ParallelDims, device: torch.device | str = "cpu") -> None:
        super().__init__(dims)
        self.device = device
        self.inputs: dict[int, tuple[Tensor, ...]] = {}
        self.outputs: dict[int, tuple[Tensor, ...] | Tensor] = {}

    def receive(self, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Micro-batch i's (hidden, residual) from the previous stage, as leaves that keep their gradient."""
        hidden, residual = (self.recv_hidden(shape, dtype, self.device).requires_grad_() for _ in range(2))
        self.inputs[i] = (hidden, residual)
        return hidden, residual

    def produced(self, i: int, out) -> None:
        """Micro-batch i's output: the loss on the last stage, else (hidden, residual), sent on."""
        self.outputs[i] = out
        if not self.last:
            for t in out:
                self._send(t.detach().contiguous(), self.stage + 1)

    def backward(self, i: int) -> None:
        """Micro-batch i's backward: from the loss, or from the gradients the next stage sends."""
        out = self.outputs.pop(i)
        if isinstance(out, Tensor):  # the last stage's loss
            out.backward()
        else:
            grads = [recv(t.shape, t.dtype, self.stage + 1, self.group, device=t.device) for t in out]
            torch.autograd.backward(list(out), grads)
        if not self.first:
            for t in self.inputs.pop(i):
                assert t.grad is not None  # backward reached this stage's inputs
                self._send(t.grad.contiguous(), self.stage - 1)

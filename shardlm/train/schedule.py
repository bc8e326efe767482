"""A stage's side of a pipeline schedule (the orders: parallel/schedules.py).

Between stages travel the hidden state and the residual stream (forward) and their gradients
(backward), point to point on the pp group (``StageLinks``, as inference's pipeline uses them):
sends are asynchronous, receives block. Chunk c of stage s is virtual stage c * p + s
(interleaved schedule; else c = 0): its input comes from stage s - 1, or for s = 0 from the last
stage's chunk c - 1, and its output goes to stage s + 1, or for s = p - 1 to stage 0's chunk
c + 1. Every schedule sends and receives on each pair of stages in the same order (a test checks
it), so the messages match on an ordered transport (NCCL) as on gloo.

ZB-H1 splits each backward in two. B is torch.distributed.pipelining's
``stage_backward_input``: it computes the gradient of the stage's inputs, which the previous
stage waits for, and keeps the gradients that reach the nodes where the weights' gradients
branch off. W (``weight_gradients``) runs backward from those nodes to the weights, later. The
first virtual stage has no input gradient to give: its B does nothing and its W is the whole
backward, as in torch's own zero-bubble schedules. W is ours, not torch's
``stage_backward_weight``: that one sets ``.grad`` itself, which no post-accumulate-grad hook
sees, so ZeRO's reductions (counted by those hooks) waited for the end of the step and ZeRO-2
held every full gradient until then (the ZeRO table test measured it); ``autograd.backward``
into the weights accumulates as any backward does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import stage_backward_input

from shardlm.parallel.comm import recv
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.pipeline import StageLinks

Key = tuple[int, int]  # (micro-batch, chunk)


class StageIO(StageLinks):
    """A stage's activations in flight: what each chunk of each micro-batch received (to send back
    its gradient) and produced (to run backward from), and its deferred weight gradients."""

    def __init__(
        self,
        dims: ParallelDims,
        device: torch.device | str = "cpu",
        virtual: int = 1,
        weights: Callable[[], list[nn.Parameter]] = list,
    ) -> None:
        """``virtual``: chunks on this stage; ``weights``: the leaf tensors whose gradients a
        split backward's W computes (ZB-H1)."""
        super().__init__(dims)
        self.device, self.virtual, self.weights = device, virtual, weights
        self.inputs: dict[Key, tuple[Tensor, ...]] = {}
        self.outputs: dict[Key, tuple[Tensor, ...] | Tensor] = {}
        self.deferred: dict[Key, Callable[[], object]] = {}
        self.held = self.peak = 0  # micro-batch chunks whose activations are held, now and at most

    def first_in(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the first virtual stage (it embeds the tokens)."""
        return self.first and chunk == 0

    def last_in(self, chunk: int) -> bool:
        """Whether ``chunk`` here is the last virtual stage (it computes the loss)."""
        return self.last and chunk == self.virtual - 1

    def receive(self, i: int, chunk: int, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Micro-batch i's (hidden, residual) for ``chunk``, from the virtual stage before, as
        leaves that keep their gradient."""
        src = (self.stage - 1) % self.stages
        hidden, residual = (recv(shape, dtype, src, self.group, device=self.device).requires_grad_() for _ in range(2))
        self.inputs[i, chunk] = (hidden, residual)
        return hidden, residual

    def produced(self, i: int, chunk: int, out) -> None:
        """Micro-batch i's output of ``chunk``: the loss on the last virtual stage, else (hidden,
        residual), sent on."""
        self.outputs[i, chunk] = out
        self.held += 1
        self.peak = max(self.peak, self.held)
        if not self.last_in(chunk):
            for t in out:
                self._send(t.detach().contiguous(), (self.stage + 1) % self.stages)

    def _output_grads(self, i: int, chunk: int) -> tuple[list[Tensor], list[Tensor] | None]:
        """The chunk's outputs and the gradients the next virtual stage sends for them (None:
        the loss, which backward starts from)."""
        out = self.outputs.pop((i, chunk))
        if isinstance(out, Tensor):
            return [out], None
        src = (self.stage + 1) % self.stages
        return list(out), [recv(t.shape, t.dtype, src, self.group, device=t.device) for t in out]

    def _send_input_grads(self, grads) -> None:
        for g in grads:
            assert g is not None  # backward reached this stage's inputs
            self._send(g.contiguous(), (self.stage - 1) % self.stages)

    def backward(self, i: int, chunk: int) -> None:
        """Micro-batch i's whole backward through ``chunk``."""
        outs, grads = self._output_grads(i, chunk)
        torch.autograd.backward(outs, grads)
        if not self.first_in(chunk):
            self._send_input_grads([t.grad for t in self.inputs.pop((i, chunk))])
        self.held -= 1

    def backward_input(self, i: int, chunk: int) -> None:
        """ZB-H1's B: the gradient of the chunk's inputs, sent back; the weights' part deferred."""
        outs, grads = self._output_grads(i, chunk)
        if self.first_in(chunk):  # nobody waits for its input gradient: W runs the whole backward
            self.deferred[i, chunk] = lambda: torch.autograd.backward(outs, grads)
            return
        inputs = list(self.inputs.pop((i, chunk)))
        dinputs, groups = stage_backward_input(outs, grads, inputs, iter(self.weights()))
        self._send_input_grads(dinputs)
        self.deferred[i, chunk] = lambda: weight_gradients(groups)

    def backward_weight(self, i: int, chunk: int) -> None:
        """ZB-H1's W: the weights' gradients of micro-batch i's chunk; its activations are freed."""
        self.deferred.pop((i, chunk))()
        self.held -= 1


def weight_gradients(groups: list[dict]) -> None:
    """ZB-H1's W: for each of ``stage_backward_input``'s parameter groups, backward from the nodes
    where its weights branch off (with the gradients B kept there) into the weights. Where a group
    has several such nodes, each passes on only what B kept for it (as torch's W does), else a
    node downstream of another would count the other's gradient twice."""
    for group in groups:
        kept = group.pop("grads", None)  # None: B never reached the group (a weight this graph skips)
        nodes = group.pop("intermediates")
        if kept is None:
            continue
        edges = [
            GradientEdge(node, k) for node, grads in zip(nodes, kept) for k, g in enumerate(grads) if g is not None
        ]
        grads = [g for got in kept for g in got if g is not None]
        handles = (
            [node.register_prehook(lambda _, got=got: got) for node, got in zip(nodes, kept)] if len(nodes) > 1 else []
        )
        try:
            torch.autograd.backward(edges, grads, inputs=[acc.variable for acc in group["params"]])
        finally:
            for handle in handles:
                handle.remove()

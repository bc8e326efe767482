"""What autograd keeps for backward, measured: the check on the planner's activation count.

``saved_for_backward()`` records, while it is active, every tensor autograd saves (through
``save_for_backward`` and the built-in ops' own saving) by the storage it lives in, so views of
one tensor count once and a tensor's whole storage counts even where only a view is saved.
``layer_activations`` wraps decoder layers' forwards in it and runs one training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Set

import torch


@contextlib.contextmanager
def saved_for_backward(exclude: Set[int] = frozenset()) -> Iterator[dict[int, int]]:
    """Yields {storage address: bytes} of the tensors saved for backward inside the block, less
    the storages in ``exclude`` (e.g. the parameters')."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def layer_activations(trainer, batch: torch.Tensor, layer: int) -> int:
    """Bytes that decoder layer ``layer`` (of this rank's model, not the last) saves for backward
    in one ``trainer.step(batch)``, parameters left out, and tensors the next layer saves too
    (the rotary tables every layer shares)."""
    if trainer.zero.stage == 3:  # the innermost saved-tensor hook wins: this one would displace ZeRO-3's
        raise ValueError(
            "layer_activations measures ZeRO stages 0-2: under ZeRO-3 its hook would replace the "
            "one that drops gathered weights, and count (and keep) them"
        )
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    counts: list[dict[int, int]] = []
    for module in trainer.model.layers[layer : layer + 2]:

        def counted(*args, forward=module.forward, **kwargs):
            with saved_for_backward(params) as saved:
                out = forward(*args, **kwargs)
            counts.append(saved)
            return out

        module.forward = counted
    try:
        trainer.step(batch)
    finally:
        for module in trainer.model.layers[layer : layer + 2]:
            del module.forward  # the class's forward again
    mine, nxt = counts[0], counts[1]
    return sum(n for ptr, n in mine.items() if ptr not in nxt)

"""A training step on a rank as an ordered log of what ran: layer compute and ZeRO's collectives
(for tests/distributed/test_overlap.py; module level, so ranks can import it)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


class _Logged:
    """A collective in flight whose ``wait()`` is logged as (kind, "wait", what)."""

    def __init__(self, pending, log: list, kind: str, what):
        self.pending, self.log, self.kind, self.what = pending, log, kind, what

    def wait(self):
        self.log.append((self.kind, "wait", self.what))
        return self.pending.wait()


def step_events(model: str, batch, **options) -> list[tuple]:
    """One step of a Trainer at this layout, logged in order:

    * ("fwd", i, "begin" | "end"): decoder layer i's forward;
    * ("bwd", i, "begin" | "end"): layer i's backward (the gradient of its output, then of its input);
    * ("backward", "begin" | "end", last): each micro-batch's backward (``Zero.backward``);
    * ("gather", "start" | "wait" | "now", unit): ZeRO-3's all-gathers (prefetched or blocking);
    * ("reduce", "start" | "wait" | "now", bucket): gradient reductions (asynchronous or blocking)."""
    from shardlm.models.transformer import DecoderLayer
    from shardlm.train import overlap, zero
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    log: list[tuple] = []
    layers = [m for m in trainer.model.modules() if isinstance(m, DecoderLayer)]
    for i, layer in enumerate(layers):

        def before(_, args, i=i):
            log.append(("fwd", i, "begin"))
            if args[0].requires_grad:
                args[0].register_hook(lambda g: log.append(("bwd", i, "end")))

        def after(_, args, out, i=i):
            log.append(("fwd", i, "end"))
            if out[0].requires_grad:
                out[0].register_hook(lambda g: log.append(("bwd", i, "begin")))

        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
    units = trainer.zero.units
    real = {
        "gather": zero.Unit.gather,
        "gather_start": zero.Unit.gather_start,
        "start": overlap.Bucket.start,
    }

    def gather(unit):
        log.append(("gather", "now", units.index(unit)))
        return real["gather"](unit)

    def gather_start(unit):
        log.append(("gather", "start", units.index(unit)))
        return _Logged(real["gather_start"](unit), log, "gather", units.index(unit))

    def start(bucket, stage, overlap):
        what = tuple(units.index(u) for u in bucket.units)
        log.append(("reduce", "start" if overlap else "now", what))
        real["start"](bucket, stage, overlap)
        if overlap:
            bucket.result = _Logged(bucket.result, log, "reduce", what)

    backward = trainer.zero.backward

    @contextlib.contextmanager
    def logged_backward(last: bool, chunk: int = 0):
        log.append(("backward", "begin", last))
        with backward(last, chunk):
            yield
        log.append(("backward", "end", last))

    zero.Unit.gather, zero.Unit.gather_start, overlap.Bucket.start = gather, gather_start, start
    trainer.zero.backward = logged_backward
    try:
        trainer.step(batch)
    finally:  # the rank serves later tests
        zero.Unit.gather, zero.Unit.gather_start, overlap.Bucket.start = real.values()
    return log

"""Pipeline schedules: the order in which each stage runs its micro-batches' passes.

One definition serves the trainer (train/schedule.py runs it) and the planner (plan/schedule.py
simulates it), so the planner models exactly what the trainer does. An operation is
(kind, micro-batch, chunk): F forward, B backward (under ZB-H1 only its input-gradient half),
W the weight-gradient half (ZB-H1); chunk c of stage s is virtual stage c * p + s (interleaved:
v chunks per stage, else one).

* GPipe (Huang et al. 2019, https://arxiv.org/abs/1811.06965): every forward, then every
  backward; a stage holds all m micro-batches' activations.
* 1F1B (PipeDream-Flush; Narayanan et al. 2021, https://arxiv.org/abs/2104.04473 §2.2): stage s
  warms up with p-1-s forwards, then alternates one forward and one backward, then drains; it
  holds at most p - s micro-batches. Bubble (p-1)/(m+p-1) of the step, as GPipe's.
* Interleaved 1F1B (same paper §2.2.2): each stage holds v chunks of layers (virtual stages
  s, s+p, ..., s+(v-1)p); micro-batches go through the chunks in groups of p, so m must be a
  multiple of p (Megatron-LM's rule). Bubble (p-1)/(v m + p - 1).
* ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", https://arxiv.org/abs/2401.10241
  §3.1): each backward is split into B (the input gradient, which the previous stage waits for)
  and W (the weight gradient, which nobody waits for). Stage s warms up with p - s forwards, runs
  s rounds of B, F with the W deferred, then B, W, F in the steady state and B, W in the drain, the
  s deferred W filling the tail. A stage holds at most p micro-batches (1F1B's first stage's
  peak: activations are freed by W), and with T_F = T_B = T_W the bubble is (p-1)/(3m+p-1), a
  third of 1F1B's.
"""

from __future__ import annotations

from shardlm.errors import UsageError

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")

Op = tuple[str, int, int]
"""(kind, micro-batch, chunk): kind F, B or W."""


def check_schedule(schedule: str, stages: int, micro: int | None, virtual: int = 1, layers: int | None = None) -> None:
    """Refuse a schedule these sizes cannot run, in one line that names the value and the fix
    (``micro``: micro-batches per step, None: not known yet; ``layers``: the model's decoder
    layers, which the interleaved chunks split evenly)."""
    if schedule not in PIPELINE_SCHEDULES:
        raise UsageError(f"pipeline schedule {schedule!r} is unknown; use one of {', '.join(PIPELINE_SCHEDULES)}")
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < 1:
        raise UsageError(f"vpp={virtual!r}: chunks per pipeline stage must be a positive integer")
    if schedule != "interleaved":
        if virtual > 1:
            raise UsageError(
                f"vpp={virtual} chunks per stage is the interleaved schedule's; use --pp-schedule interleaved, or vpp=1"
            )
        return
    if virtual < 2:
        raise UsageError("the interleaved schedule holds several chunks of layers per stage; give vpp >= 2")
    if stages < 2:
        raise UsageError(f"the interleaved schedule interleaves pipeline stages; pp={stages} has none to interleave")
    if micro is not None and micro % stages:
        raise UsageError(
            f"the interleaved schedule runs micro-batches in groups of pp={stages}; grad_accum={micro} is not a "
            f"multiple of {stages} (use {max(stages, micro // stages * stages)} or {(micro // stages + 1) * stages})"
        )
    if layers is not None and layers % (stages * virtual):
        ok = [v for v in range(2, layers // stages + 1) if layers % (stages * v) == 0]
        raise UsageError(
            f"vpp={virtual}: the model's {layers} layers do not split into pp x vpp = {stages * virtual} equal "
            f"chunks; use vpp in {ok}" + ("" if ok else " (none at this pp: use another pp or schedule)")
        )


def virtual_stage_layers(layers: int, stages: int, virtual: int, stage: int) -> list[range]:
    """The layers of each chunk of ``stage`` under the interleaved schedule: virtual stage
    c * p + s holds the (c * p + s)-th of pp x vpp equal runs."""
    per = layers // (stages * virtual)
    return [range((c * stages + stage) * per, (c * stages + stage + 1) * per) for c in range(virtual)]


def stage_orders(schedule: str, stages: int, micro: int, virtual: int = 1) -> list[list[Op]]:
    """Every stage's operations in the order it runs them."""
    check_schedule(schedule, stages, micro, virtual)
    p, m, v = stages, micro, virtual
    if schedule == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p)]
    if schedule == "1f1b":
        out = []
        for s in range(p):
            warm = min(p - 1 - s, m)
            ops: list[Op] = [("F", i, 0) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i, 0), ("B", i, 0)]
            out.append(ops + [("B", i, 0) for i in range(m - warm, m)])
        return out
    if schedule == "interleaved":
        return [_interleaved(p, m, v, s) for s in range(p)]
    return [_zb_h1(p, m, s) for s in range(p)]


def _interleaved(p: int, m: int, v: int, s: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B for stage s: the k-th forward of the stage is micro-batch
    (k // pv) p + k % p on chunk (k // p) % v; backwards go through the chunks in reverse."""
    total = m * v

    def fwd(k: int) -> Op:
        return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def bwd(k: int) -> Op:
        return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    warm = min((p - s - 1) * 2 + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warm)]
    for k in range(total - warm):
        ops += [fwd(warm + k), bwd(k)]
    return ops + [bwd(k) for k in range(total - warm, total)]


def _zb_h1(p: int, m: int, s: int) -> list[Op]:
    ops: list[Op] = [("F", i, 0) for i in range(min(p - s, m))]
    f = len(ops)  # the next forward, backward and weight gradient
    b = w = 0
    for _ in range(s):  # W deferred: these rounds fill what would be the warm-up's idle time
        if f == m:
            break
        ops += [("B", b, 0), ("F", f, 0)]
        b, f = b + 1, f + 1
    while f < m:
        ops += [("B", b, 0), ("W", w, 0), ("F", f, 0)]
        b, w, f = b + 1, w + 1, f + 1
    while b < m:
        ops += [("B", b, 0), ("W", w, 0)]
        b, w = b + 1, w + 1
    return ops + [("W", i, 0) for i in range(w, m)]


def in_flight(order: list[Op]) -> int:
    """The most micro-batch chunks whose activations a stage holds at once when it runs
    ``order``: from its forward until its backward (until its W under ZB-H1)."""
    release = "W" if any(kind == "W" for kind, _, _ in order) else "B"
    held = peak = 0
    for kind, _, _ in order:
        held += 1 if kind == "F" else -1 if kind == release else 0
        peak = max(peak, held)
    return peak

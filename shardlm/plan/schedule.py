"""Pipeline schedule simulator: the timeline of the schedules the trainer runs (GPipe, 1F1B,
interleaved 1F1B and ZB-H1; their orders and sources: parallel/schedules.py).

Each stage runs its own ordered list of operations (F = forward, B = backward or, for
ZB-H1, the input-gradient half, W = the weight-gradient half); an operation starts when its
stage is free and its inputs have arrived from the neighbouring stage (plus ``p2p_s``). As the
trainer does, ZB-H1's first stage runs its whole backward as W (no stage waits for its input
gradient; torch.distributed.pipelining does the same).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.errors import UsageError
from shardlm.parallel.schedules import stage_orders
from shardlm.plan.errors import PlanError


@dataclass(frozen=True)
class Event:
    stage: int
    """Pipeline stage (rank of the pp group)."""
    kind: str
    """F (forward), B (backward, or its input-gradient half in ZB-H1) or W (weight gradient)."""
    micro: int
    """Micro-batch index."""
    chunk: int
    """Model chunk on the stage (interleaved schedule), else 0."""
    start: float
    end: float


@dataclass
class Timeline:
    schedule: str
    """Schedule name."""
    stages: int
    """Pipeline stages p."""
    micro: int
    """Micro-batches m."""
    virtual: int
    """Model chunks per stage v."""
    events: list[Event] = field(default_factory=list)
    """Every operation with its start and end time."""

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, stage: int) -> float:
        return sum(e.end - e.start for e in self.events if e.stage == stage)

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the step, averaged over stages."""
        span = self.makespan
        return sum(span - self.busy(s) for s in range(self.stages)) / (self.stages * span)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batch chunks whose activations the stage holds at once (F done, last use not)."""
        deltas = []
        release = "W" if any(e.kind == "W" for e in self.events) else "B"
        for e in self.events:
            if e.stage == stage and e.kind == "F":
                deltas.append((e.start, 1))
            if e.stage == stage and e.kind == release:
                deltas.append((e.end, -1))
        peak = cur = 0
        for _, d in sorted(deltas, key=lambda x: (x[0], x[1])):
            cur += d
            peak = max(peak, cur)
        return peak


def simulate(
    schedule: str,
    *,
    stages: int,
    micro: int,
    t_f: float,
    t_b: float,
    t_w: float = 0.0,
    virtual: int = 1,
    p2p_s: float = 0.0,
) -> Timeline:
    """Run the schedule. ``t_f``/``t_b`` are per stage per micro-batch (a chunk takes 1/virtual);
    for ZB-H1, ``t_b`` is the input-gradient part and ``t_w`` the weight-gradient part."""
    p, m, v = stages, micro, virtual if schedule == "interleaved" else 1
    if p < 1 or m < 1:
        raise PlanError(f"a pipeline needs stages >= 1 and micro-batches >= 1 (got {p}, {m})")
    dur = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    try:
        orders = stage_orders(schedule, p, m, v)
    except UsageError as e:
        raise PlanError(str(e)) from None
    done: dict[tuple[str, int, int], float] = {}  # (kind, micro, virtual stage) -> end
    free = [0.0] * p
    pos = [0] * p
    events: list[Event] = []
    last_vs = p * v - 1
    while any(pos[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, mb, c = orders[s][pos[s]]
                vs = c * p + s  # virtual stage of chunk c on stage s
                if kind == "F":
                    dep = None if vs == 0 else ("F", mb, vs - 1)
                elif kind == "B":
                    dep = ("F", mb, vs) if vs == last_vs else ("B", mb, vs + 1)
                else:
                    dep = ("B", mb, vs)
                if dep is not None and dep not in done:
                    break
                ready = 0.0 if dep is None else done[dep] + (p2p_s if dep[2] != vs else 0.0)
                if kind == "B" and vs == last_vs and dep is not None:  # its own forward: no hop
                    ready = done[dep]
                start = max(free[s], ready)
                end = start + dur[kind]
                if schedule == "zb-h1" and vs == 0 and kind != "F":  # its whole backward runs as W
                    end = start + (0.0 if kind == "B" else dur["B"] + dur["W"])
                done[(kind, mb, vs)] = end
                free[s] = end
                events.append(Event(s, kind, mb, c, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked; this is a bug in the order generator")
    return Timeline(schedule=schedule, stages=p, micro=m, virtual=v, events=events)


def bubble_fraction(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """Closed forms for uniform stages: (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1);
    ZB-H1 with T_F = T_B = T_W: (p-1)/(3m+p-1)."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)

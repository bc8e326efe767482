"""Pipeline schedule simulator: the timeline of GPipe, 1F1B, interleaved 1F1B and ZB-H1.

Each stage runs its own ordered list of operations (F = forward, B = backward or, for
ZB-H1, the input-gradient half, W = the weight-gradient half); an operation starts when its
stage is free and its inputs have arrived from the neighbouring stage (plus ``p2p_s``).

* GPipe (Huang et al. 2019, https://arxiv.org/abs/1811.06965): all forwards, then all backwards.
* 1F1B (PipeDream-Flush; Narayanan et al. 2021, https://arxiv.org/abs/2104.04473 §2.2):
  stage s warms up with p-s-1 forwards, then alternates one forward and one backward.
* Interleaved 1F1B (same paper §2.2.1): v model chunks per stage, micro-batches in groups of p;
  needs m to be a multiple of p. Bubble (p-1)/(v m + p - 1) of the step for uniform stages.
* ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", https://arxiv.org/abs/2401.10241 §3):
  1F1B's order and memory, with each backward split into B and W; W is deferred to fill
  the bubbles, leaving (p-1)(T_F + T_B - T_W) idle per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardlm.plan.errors import PlanError

Op = tuple[str, int, int]  # (kind, micro-batch, chunk)


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


def _orders(schedule: str, p: int, m: int, v: int) -> list[list[Op]]:
    if schedule == "gpipe":
        return [[("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)] for _ in range(p)]
    if schedule == "1f1b":
        out = []
        for s in range(p):
            warm = min(p - s - 1, m)
            ops: list[Op] = [("F", i, 0) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i, 0), ("B", i, 0)]
            ops += [("B", i, 0) for i in range(m - warm, m)]
            out.append(ops)
        return out
    if schedule == "interleaved":
        total = m * v

        def fwd(k: int) -> Op:
            return ("F", (k // (p * v)) * p + k % p, (k // p) % v)

        def bwd(k: int) -> Op:
            return ("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

        out = []
        for s in range(p):
            warm = min((p - s - 1) * 2 + (v - 1) * p, total)
            ops = [fwd(k) for k in range(warm)]
            for i in range(total - warm):
                ops += [fwd(warm + i), bwd(i)]
            ops += [bwd(i) for i in range(total - warm, total)]
            out.append(ops)
        return out
    raise PlanError(f"unknown pipeline schedule {schedule!r}; pick gpipe, 1f1b, interleaved or zb-h1")


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
    if schedule == "interleaved" and m % p:
        raise PlanError(
            f"the interleaved schedule runs micro-batches in groups of pp={p}; {m} is not a multiple "
            f"of {p} (use {max(p, m // p * p)} or {(m // p + 1) * p})"
        )
    dur = {"F": t_f / v, "B": t_b / v, "W": t_w / v}
    if schedule == "zb-h1":
        return Timeline(schedule=schedule, stages=p, micro=m, virtual=1, events=_simulate_zb_h1(p, m, dur, p2p_s))
    orders = _orders(schedule, p, m, v)
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
                done[(kind, mb, vs)] = end
                free[s] = end
                events.append(Event(s, kind, mb, c, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocked; this is a bug in the order generator")
    return Timeline(schedule=schedule, stages=p, micro=m, virtual=v, events=events)


def _simulate_zb_h1(p: int, m: int, dur: dict[str, float], p2p_s: float) -> list[Event]:
    """ZB-H1: 1F1B's order of F and B on every stage; each W (weight gradient) waits in a
    queue and runs when the stage would otherwise sit idle, or when the stage already holds
    p micro-batches (the first stage's 1F1B peak, which ZB-H1 keeps as the limit, Qi et al. §3.1)."""
    orders = _orders("1f1b", p, m, 1)
    end: dict[tuple[str, int, int], float] = {}
    pos, free, held = [0] * p, [0.0] * p, [0] * p
    pending: list[list[int]] = [[] for _ in range(p)]
    events: list[Event] = []

    def ready(s: int) -> float | None:
        """When the stage's next F/B could start (None: its input is not computed yet)."""
        kind, mb, _ = orders[s][pos[s]]
        if kind == "F":
            dep = ("F", mb, s - 1) if s > 0 else None
        else:
            dep = ("F", mb, s) if s == p - 1 else ("B", mb, s + 1)
        if dep is None:
            return 0.0
        if dep not in end:
            return None
        return end[dep] + (p2p_s if dep[2] != s else 0.0)

    def run(s: int, kind: str, mb: int, t: float) -> None:
        finish = t + dur[kind]
        end[(kind, mb, s)] = finish
        free[s] = finish
        events.append(Event(s, kind, mb, 0, t, finish))

    while len(events) < 3 * m * p:
        # the stage whose next action starts earliest goes first (ties: lower stage)
        best = None
        for s in range(p):
            if pos[s] < len(orders[s]):
                r = ready(s)
                must_w = pending[s] and orders[s][pos[s]][0] == "F" and held[s] >= p
                if r is not None and not must_w and r <= free[s]:
                    cand = (free[s], s, "op")
                elif pending[s]:
                    cand = (free[s], s, "W")  # idle until r (or unknown): fill with a W
                elif r is not None:
                    cand = (r, s, "op")
                else:
                    continue
            elif pending[s]:
                cand = (free[s], s, "W")
            else:
                continue
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            raise RuntimeError("ZB-H1 simulation deadlocked; this is a bug")
        t, s, what = best
        if what == "W":
            run(s, "W", pending[s].pop(0), t)
            held[s] -= 1
            continue
        kind, mb, _ = orders[s][pos[s]]
        run(s, kind, mb, t)
        pos[s] += 1
        if kind == "F":
            held[s] += 1
        else:
            pending[s].append(mb)
    return events


def bubble_fraction(schedule: str, *, p: int, m: int, v: int = 1) -> float:
    """Closed forms for uniform stages: (p-1)/(m+p-1); interleaved (p-1)/(v m+p-1);
    ZB-H1 with T_F = T_B = T_W: (p-1)/(3m+p-1)."""
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)

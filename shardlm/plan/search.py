"""Layout search: enumerate every valid layout, score it, keep the best.

Mesh shapes come from ``factorisations(world, 4)`` (dp, pp, cp, tp) and are validated by
ParallelDims (through ``Layout``); tp is capped by the query heads and pp by the layers; for
MoE models every ep that folds into dp x tp and does not exceed the experts is tried. For
training each shape is tried with every micro-batch size that divides the replica batch,
every pipeline schedule, SP on and off, ZeRO 0-3, and the least recomputation that fits.

Objectives: ``throughput`` (output tokens/s for inference, tokens/s for training), ``latency``
(TTFT + output_len x TPOT at batch 1, or at the workload's concurrency or rate: ``serving.py``);
with ``max_ttft_s`` / ``max_tpot_s`` the throughput objective keeps only layouts and batch sizes
within the limits. With ``--prefill-replicas auto`` each inference layout is tried colocated and
with every split of its replicas into prefill and decode pools that the engine makes, and keeps the
best.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from shardlm.parallel.context import check_ulysses
from shardlm.parallel.dims import LayoutError, factorisations
from shardlm.plan import inference, training
from shardlm.plan.disagg import check as check_split
from shardlm.plan.errors import PlanError
from shardlm.plan.hardware import Cluster
from shardlm.plan.layout import CP_ATTENTION, Layout
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.runnable import split_refused

OBJECTIVES = ("throughput", "latency")
MICRO_BATCHES = (1, 2, 4, 8)
"""Micro-batch sizes tried in training (larger ones rarely pay off and cost memory)."""
VIRTUAL_CHUNKS = (2, 4)
"""Model chunks per stage tried for the interleaved schedule."""


@dataclass
class SearchResult:
    results: list
    """Fitting results, best first."""
    rejected: list
    """Results that do not fit (or miss a limit), least short first."""
    evaluated: int
    """Layout evaluations made (a batch-size bisection counts each step)."""
    seconds: float
    """Wall time of the search."""

    @property
    def rate(self) -> float:
        return self.evaluated / max(self.seconds, 1e-9)


def shapes(cfg, cluster: Cluster, fixed: dict[str, int]) -> list[Layout]:
    """Every (dp, pp, cp, tp, ep) layout the model and cluster allow, honouring fixed dims."""
    out = []
    if "attention_dp" in fixed and not cfg.is_moe:
        raise PlanError(
            f"--attention-dp runs attention data-parallel beside expert-parallel MoE layers, and {cfg.family} has "
            f"no experts: drop --attention-dp (its dp replicas are plain data parallelism)"
        )
    for dp, pp, cp, tp in factorisations(cluster.num_gpus, 4):
        dims = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
        if any(k in fixed and fixed[k] != v for k, v in dims.items()):
            continue
        if tp > cfg.num_heads or pp > cfg.num_layers:
            continue
        eps, etp = [1], fixed.get("etp", 1)
        if cfg.is_moe:
            eps = [e for e in range(1, dp * tp + 1) if (dp * tp) % (e * etp) == 0 and e <= cfg.num_experts]
        elif etp > 1:
            raise PlanError(f"--etp {etp} splits experts, but {cfg.family} has none; drop --etp")
        for ep in eps:
            if "ep" in fixed and fixed["ep"] != ep:
                continue
            lay = Layout(dp=dp, pp=pp, cp=cp, tp=tp, ep=ep, etp=etp)
            if "attention_dp" in fixed and lay.attention_dp(cfg.is_moe) != fixed["attention_dp"]:
                continue
            out.append(lay)
    return out


def _score(res, objective: str) -> float:
    if objective == "latency":
        return -(res.latency_s if hasattr(res, "latency_s") else res.step_s)
    return res.throughput if hasattr(res, "throughput") else res.tokens_per_s


def search_inference(
    costs: ModelCosts, cluster: Cluster, wl: inference.InferenceWorkload, *, objective: str, fixed: dict[str, int]
) -> SearchResult:
    t0 = time.perf_counter()
    ok: list[inference.InferenceResult] = []
    bad: list[inference.InferenceResult] = []
    n = 0
    layouts = shapes(costs.cfg, cluster, fixed)
    if wl.prefill_replicas != 0 and layouts:  # a prefill/decode split needs a decode replica beside the prefill ones
        check_split(wl.prefill_replicas, max(lay.dp for lay in layouts), wl.output_len)
        if wl.prefill_replicas is not None:
            layouts = [lay for lay in layouts if lay.dp > wl.prefill_replicas]
    for lay in layouts:
        if wl.cp_attention == "ulysses" and not ulysses_fits(costs.cfg, lay.tp, lay.cp):
            continue  # the engine refuses it (engine/config.py)
        splits: Sequence[int]
        if wl.prefill_replicas is not None:
            splits = [wl.prefill_replicas]
        else:  # auto: colocated, and every split of the replicas that the engine makes
            splits = range(lay.dp if split_refused(costs.cfg, lay) is None else 1)
        tried = []
        for split in splits:
            res, k = _evaluate_inference(costs, cluster, lay, replace(wl, prefill_replicas=split), objective)
            n += k
            tried.append(res)
        res = min(tried, key=lambda r: (not (r.fits and r.meets_limits), -_score(r, objective), r.latency_s))
        (ok if res.fits and res.meets_limits else bad).append(res)
    # at a rate every layout that keeps up serves the same tokens/s: the lower latency goes first
    ok.sort(key=lambda r: (-_score(r, objective), r.latency_s))
    bad.sort(key=lambda r: (not r.fits, r.shortfall_bytes))
    return SearchResult(results=ok, rejected=bad, evaluated=n, seconds=time.perf_counter() - t0)


def _evaluate_inference(
    costs: ModelCosts, cluster: Cluster, lay: Layout, wl: inference.InferenceWorkload, objective: str
) -> tuple[inference.InferenceResult, int]:
    """One layout's result for the objective, and the evaluations it took."""
    if objective == "latency":
        # at a load the replica runs as many as fit, as a server does; alone, one request
        return inference.evaluate(costs, cluster, lay, wl, batch=wl.batch or (None if wl.loaded else 1)), 1
    res = inference.evaluate(costs, cluster, lay, wl)
    n = 1
    if res.fits and not res.meets_limits and wl.batch is None and wl.max_tpot_s is not None:
        lo, hi = 1, res.batch  # TPOT grows with the batch: largest batch within the limit
        best = None
        while lo <= hi:
            mid = (lo + hi) // 2
            r = inference.evaluate(costs, cluster, lay, wl, batch=mid)
            n += 1
            if r.meets_limits:
                best, lo = r, mid + 1
            else:
                hi = mid - 1
        res = best or inference.evaluate(costs, cluster, lay, wl, batch=1)
    return res, n


def training_variants(cfg, lay: Layout, wl: training.TrainWorkload, fixed: dict) -> list[Layout]:
    """Training knobs for one mesh shape. Options the time and memory models say are dominated
    are left out unless pinned: ZeRO-0 (ZeRO-1 sends less: a float32 reduce-scatter and a 16-bit
    all-gather against a float32 all-reduce; and holds less memory), TP without SP (same traffic,
    more memory) and GPipe (1F1B has the same bubble and less memory)."""
    if wl.global_batch % lay.dp:
        return []
    per_replica = wl.global_batch // lay.dp
    schedules: list[tuple[str, int]] = [("1f1b", 1)]
    # interleaving depths that give each chunk of an evenly split stage a layer: uneven where the layers
    # do not divide, as Megatron's --pipeline-model-parallel-layout places them (runnable.py marks what
    # shardlm refuses)
    chunkings = [v for v in VIRTUAL_CHUNKS if cfg.num_layers // lay.pp >= v]
    if lay.pp > 1:
        schedules += [("zb-h1", 1)] + [("interleaved", v) for v in chunkings]
    if "schedule" in fixed:
        schedules = [s for s in schedules if s[0] == fixed["schedule"]] or [(fixed["schedule"], 1)]
        if fixed["schedule"] == "interleaved":
            schedules = [("interleaved", v) for v in chunkings]
    if "virtual" in fixed:  # --vpp: the interleaved schedule at that depth only; pinned, its chunks
        # may be uneven, some with no decoder layer (an embedding- or loss-only chunk), as Megatron's
        # --pipeline-model-parallel-layout places them (runnable.py marks what shardlm's trainer refuses)
        schedules = [("interleaved", fixed["virtual"])] if lay.pp > 1 else []
    sps = (fixed["sp"],) if "sp" in fixed else (True,)
    if lay.tp == 1:
        if fixed.get("sp"):
            return []
        sps = (False,)
    attentions = [fixed["cp_attention"]] if "cp_attention" in fixed else list(CP_ATTENTION)
    if lay.cp == 1:
        attentions = ["ring"]  # no cp: nothing to choose
    elif not ulysses_fits(cfg, lay.tp, lay.cp):
        attentions = [a for a in attentions if a != "ulysses"]
    zeros = (1, 2, 3) if lay.dp * lay.cp > 1 else (0,)
    if "zero" in fixed:
        zeros = (fixed["zero"],)
    out = []
    for mb in (fixed["micro_batch"],) if "micro_batch" in fixed else MICRO_BATCHES:  # a pin may be any size
        if per_replica % mb:
            continue
        m = per_replica // mb
        for sched, v in schedules:
            if sched == "interleaved" and m % lay.pp:
                continue
            for sp in sps:
                for zero in zeros:
                    for attn in attentions:
                        out.append(
                            lay.with_(
                                micro_batch=mb,
                                num_micro=m,
                                schedule=sched,
                                virtual=v,
                                sp=sp,
                                zero=zero,
                                cp_attention=attn,
                                offload=fixed.get("offload", False),
                            )
                        )
    return out


def ulysses_fits(cfg, tp: int, cp: int) -> bool:
    """Whether Ulysses splits every tp rank's heads over cp (``parallel.context.check_ulysses``)."""
    try:
        check_ulysses(cfg.num_heads, cfg.num_kv_heads, tp, cp)
    except LayoutError:
        return False
    return True


def search_training(
    costs: ModelCosts, cluster: Cluster, wl: training.TrainWorkload, *, objective: str, fixed: dict
) -> SearchResult:
    t0 = time.perf_counter()
    ok: list[training.TrainResult] = []
    bad: list[training.TrainResult] = []
    n = 0
    recomputes = [fixed["recompute"]] if "recompute" in fixed else ["none", "selective", "full"]
    for shape in shapes(costs.cfg, cluster, fixed):
        for lay in training_variants(costs.cfg, shape, wl, fixed):
            last = None
            for rc in recomputes:  # more recomputation is never faster: stop at the first that fits
                last = training.evaluate(costs, cluster, lay.with_(recompute=rc), wl)
                n += 1
                if last.fits:
                    break
            assert last is not None  # recomputes is never empty
            (ok if last.fits else bad).append(last)
    ok.sort(key=lambda r: -r.tokens_per_s)
    bad.sort(key=lambda r: r.shortfall_bytes)
    return SearchResult(results=ok, rejected=bad, evaluated=n, seconds=time.perf_counter() - t0)


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise PlanError(f"--objective {objective!r} is unknown; pick one of {', '.join(OBJECTIVES)}")

"""plan(): one request in, ranked layouts with an explanation out (what the CLI prints).

Raises PlanError when nothing can work, saying by how much it misses and what would fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardlm.plan.catalog import load_model
from shardlm.plan.errors import PlanError
from shardlm.plan.explain import compare, departures, explain, rerank
from shardlm.plan.hardware import GIB, THIS_MACHINE, Cluster, gib, gpu_names, load_gpu
from shardlm.plan.inference import InferenceWorkload, evaluate
from shardlm.plan.roofline import ModelCosts
from shardlm.plan.runnable import not_as_modelled, not_runnable
from shardlm.plan.search import SearchResult, check_objective, search_inference, search_training
from shardlm.plan.training import TrainWorkload, check_flags, check_fp8_recipe, ep_overlaps, pp_overlaps

GROWTH = (2, 4, 8, 16, 32, 64)
"""Cluster sizes, as multiples of the request, tried when suggesting what would fit."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    model: str
    """Preset name or path to a HF config.json."""
    gpu: str
    """Catalog GPU name, or ``this-machine``."""
    gpus: int
    """GPUs (ranks) in total."""
    gpus_per_node: int | None = None
    """GPUs per node (default: the GPU's reference system, capped at ``gpus``)."""
    objective: str = "throughput"
    """throughput or latency."""
    train: bool = False
    """Plan training instead of inference."""
    inference: InferenceWorkload | None = None
    """The inference workload (when not training)."""
    training: TrainWorkload | None = None
    """The training workload (with ``train``)."""
    fixed: dict = field(default_factory=dict)
    """Dimensions the user pinned (tp, pp, dp, cp, ep, zero, schedule, micro_batch, recompute)."""
    top: int = 5
    """Layouts to report."""
    memory_reserve_gib: float | None = None
    """GiB per GPU kept out of the plan (``--memory-reserve``); None: ``Cluster.reserve``'s default."""
    compare: dict | None = None
    """Pins of a layout to set beside the pick (``--compare tp8,pp16``): its best settings are
    searched and the explanation says in numbers why one wins."""


@dataclass
class Plan:
    request: PlanRequest
    """What was asked."""
    model_name: str
    """Preset name or the config's folder name."""
    cfg: object
    """The ModelConfig planned for."""
    cluster: Cluster
    """GPUs and nodes."""
    search: SearchResult
    """Every fitting result, best first, and search statistics."""
    ranked: list
    """The best result per mesh shape, after the rule tie-break: what the table shows."""
    explanation: list[str]
    """Why the winner wins, what the runner-up trades, which rules hold."""
    context: dict
    """Inputs of the rule checks (cluster, config, objective, context length)."""
    compared: object = None
    """The best result with the ``compare`` pins (or the closest to fitting, when none fits)."""

    @property
    def best(self):
        return self.ranked[0]

    def departures(self, res) -> list[str]:
        return departures(res, self.context)

    def not_runnable(self, res) -> str | None:
        """Why shardlm cannot run this result's layout yet (None: it can; ``runnable.py``)."""
        req = self.request
        split = res.split.prefill_replicas if getattr(res, "split", None) is not None else 0  # pinned or searched
        mtp = getattr(self._work(), "mtp", 0)  # training's multi-token-prediction modules
        return not_runnable(
            self.cfg, res.layout, train=req.train, dtype=self._work().dtype, prefill_replicas=split, mtp=mtp
        )

    def not_as_modelled(self, res) -> str | None:
        """Why shardlm runs this result's layout, but not as the workload prices it: without a peer's
        faster mechanism (None: as priced; ``runnable.py``)."""
        return not_as_modelled(self.cfg, res.layout, self._work(), train=self.request.train, cluster=self.cluster)

    def _work(self):
        work = self.request.training if self.request.train else self.request.inference
        assert work is not None  # a request carries the workload it plans
        return work

    def runnable_note(self) -> list[str]:
        """A line for the explanation when the pick is not one shardlm runs yet, or runs only without a
        mechanism it is priced with."""
        if (why := self.not_runnable(self.best)) is not None:
            ok = self._first(self.not_runnable)
            best = f"the best it runs is {ok}" if ok else "none ranked runs"
            return [f"The pick is not runnable by shardlm yet ({why}); {best}."]
        if (why := self.not_as_modelled(self.best)) is not None:
            ok = self._first(lambda r: self.not_runnable(r) or self.not_as_modelled(r))
            best = f"; the best it runs as priced is {ok}" if ok else ""
            return [f"The pick is priced with {why}: shardlm runs it without, slower than shown{best}."]
        return []

    def overlap_note(self, result=None, what: str = "the pick") -> list[str]:
        """A line for each of ``--ep-overlap`` and ``--pp-overlap`` asked for where ``result`` (the pick
        unless given: a ``--compare`` layout) is a layout Megatron-Core does not overlap so
        (``training.ep_overlaps``, ``training.pp_overlaps``), so that neither flag is ever silently
        left out."""
        work = self.request.training
        if not self.request.train or work is None:
            return []
        lay, out = (result or self.best).layout, []
        if work.ep_overlap and not ep_overlaps(self.cfg, lay, work):
            out.append(
                f"--ep-overlap does not apply to {what} (Megatron-Core overlaps only at ep > 1, without a "
                "pipeline or with an interleaved one, and without full recomputation): it is priced with "
                "each all-to-all waited for."
            )
        if work.pp_overlap and not pp_overlaps(lay, work):
            priced = (
                f"{what} runs no pipeline, so it has no hops to hide"
                if lay.pp == 1
                else f"{what} runs the {lay.schedule} schedule, priced with each hop waited for"
            )
            out.append(
                f"--pp-overlap does not apply to {what} (Megatron-Core overlaps the hops between stages only "
                f"in its interleaved schedule): {priced}."
            )
        return out

    def _first(self, mark) -> str | None:
        """The best ranked layout ``mark`` leaves unmarked ("#i, label"), or None."""
        i, r = next(((i, r) for i, r in enumerate(self.ranked, 1) if mark(r) is None), (0, None))
        return None if r is None else f"#{i}, {r.layout.label(self.request.train)}"


def make_cluster(req: PlanRequest) -> Cluster:
    return cluster_for(req.gpu, req.gpus, req.gpus_per_node, req.memory_reserve_gib)


def cluster_for(
    gpu_name: str, gpus: int, gpus_per_node: int | None = None, reserve_gib: float | None = None
) -> Cluster:
    """``gpus`` of the catalog GPU ``gpu_name`` (or this machine, measured), ``gpus_per_node`` a node."""
    if gpu_name == THIS_MACHINE:  # the ranks share this machine's cores, memory and bus
        from shardlm.plan.calibrate import machine_spec

        gpu, per_node = machine_spec(gpus), gpus
    else:
        gpu = load_gpu(gpu_name)
        per_node = gpus_per_node or min(gpus, gpu.gpus_per_node)
    reserve = None if reserve_gib is None else reserve_gib * GIB
    return Cluster(gpu=gpu, num_gpus=gpus, gpus_per_node=per_node, memory_reserve_bytes=reserve)


def _search(costs, cluster, req: PlanRequest, fixed: dict) -> SearchResult:
    if req.train:
        assert req.training is not None  # a training request carries its workload
        return search_training(costs, cluster, req.training, objective=req.objective, fixed=fixed)
    assert req.inference is not None
    return search_inference(costs, cluster, req.inference, objective=req.objective, fixed=fixed)


def plan(req: PlanRequest) -> Plan:
    check_objective(req.objective)
    cfg, name = load_model(req.model)
    if req.train and req.training is not None:
        check_flags(cfg, req.training, req.fixed)
    cluster = make_cluster(req)
    if req.train and req.training is not None:
        check_fp8_recipe(req.training, cluster.gpu)
    costs = ModelCosts(cfg)
    found = _search(costs, cluster, req, req.fixed)
    if req.training is not None and req.train:
        context_len = req.training.seq_len
    else:
        assert req.inference is not None
        context_len = req.inference.prompt_len + req.inference.output_len
    ctx = {"cluster": cluster, "cfg": cfg, "objective": req.objective, "train": req.train, "context_len": context_len}
    if not found.results:
        raise _nothing_fits(costs, cluster, req, name, found)
    ranked = distinct_meshes(rerank(found.results, ctx))
    out = Plan(
        request=req,
        model_name=name,
        cfg=cfg,
        cluster=cluster,
        search=found,
        ranked=ranked,
        explanation=explain(ranked, ctx),
        context=ctx,
    )
    out.explanation[:0] = out.runnable_note() + out.overlap_note()
    if not req.train and req.inference is not None and out.best.split is not None:
        out.explanation.append(colocated(costs, cluster, req.inference, out.best))
    if req.compare is not None:
        pins = {**req.fixed, **req.compare}
        theirs = _search(costs, cluster, req, pins)
        out.compared = rerank(theirs.results, ctx)[0] if theirs.results else (theirs.rejected or [None])[0]
        out.explanation += compare(out.best, out.compared, ctx, ",".join(f"{k}={v}" for k, v in req.compare.items()))
        if out.compared is not None:
            out.explanation += out.overlap_note(out.compared, "the compared layout")
    return out


def colocated(costs, cluster, wl: InferenceWorkload, split) -> str:
    """The pick's layout served without the prefill/decode split, at the same load."""
    both = evaluate(costs, cluster, split.layout, replace(wl, prefill_replicas=0))

    def ms(x: float) -> str:
        return "unbounded" if x == float("inf") else f"{x * 1e3:,.1f} ms"

    return (
        f"Colocated (every replica prefills and decodes, same layout): TTFT {ms(both.ttft_s)} vs "
        f"{ms(split.ttft_s)}, TPOT {ms(both.tpot_s)} vs {ms(split.tpot_s)}, {both.throughput:,.0f} vs "
        f"{split.throughput:,.0f} output tokens/s ({split.split.prefill_replicas} prefill replica(s) of {split.layout.dp})."
    )


def distinct_meshes(results: list) -> list:
    """The best result of each mesh shape (tp, pp, dp, cp, ep), so the table shows alternatives
    rather than the same mesh with another micro-batch size."""
    seen, out = set(), []
    for r in results:
        key = tuple(sorted(r.layout.sizes().items()))
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _nothing_fits(costs, cluster, req: PlanRequest, name: str, found: SearchResult) -> PlanError:
    gpu = cluster.gpu
    if found.rejected and found.rejected[0].fits:  # fits in memory, misses a TTFT/TPOT limit
        r = found.rejected[0]
        return PlanError(
            f"no layout of {name} on {req.gpus} x {gpu.name} meets the limits: the closest, {r.layout.label()}, "
            f"reaches TTFT {r.ttft_s * 1e3:.0f} ms and TPOT {r.tpot_s * 1e3:.1f} ms at batch {r.batch}; "
            f"relax --max-ttft-ms / --max-tpot-ms or add GPUs"
        )
    if req.fixed and found.rejected:
        free = _search(costs, cluster, req, {})
        r = found.rejected[0]
        pinned = " ".join(f"{k}={v}" for k, v in req.fixed.items())
        msg = (
            f"{pinned} cannot fit {name} on {gpu.name}: its best layout, {r.layout.label(req.train)}, needs "
            f"{r.memory.describe()} per GPU, {gib(r.shortfall_bytes)} over the {gib(gpu.memory_bytes)} it has"
        )
        if free.results:
            alts = ", ".join(x.layout.label(req.train) for x in free.results[:3])
            return PlanError(f"{msg}; layouts that fit: {alts}")
        found = free
    short = found.rejected[0].shortfall_bytes if found.rejected else float("nan")
    need = found.rejected[0].memory.describe() if found.rejected else "?"
    what = f"{name} does not fit on {req.gpus} x {gpu.name} in any layout"
    if not found.rejected:
        return PlanError(
            f"{what}: no layout is valid for {req.gpus} GPUs (heads {costs.cfg.num_heads}, layers "
            f"{costs.cfg.num_layers}); try a GPU count with more divisors"
        )
    detail = (
        f"{what}: the leanest layout, {found.rejected[0].layout.label(req.train)}, needs {need} per GPU, "
        f"{gib(short)} more than the {gib(gpu.memory_bytes)} there"
    )
    hints = []
    for k in GROWTH:
        n = req.gpus * k
        bigger = Cluster(
            gpu=gpu,
            num_gpus=n,
            gpus_per_node=min(n, cluster.gpus_per_node) if n >= cluster.gpus_per_node else n,
            memory_reserve_bytes=cluster.memory_reserve_bytes,
        )
        if _search(costs, bigger, req, {}).results:
            hints.append(f"{n} x {gpu.name}")
            break
    if req.gpu != THIS_MACHINE:
        for other in gpu_names():
            o = load_gpu(other)
            if o.memory_bytes <= gpu.memory_bytes:
                continue
            c = replace(cluster, gpu=o)
            if _search(costs, c, req, {}).results:
                hints.append(f"{req.gpus} x {other}")
                break
    if not req.train and req.inference is not None and req.inference.dtype != "fp8" and "fp8" in gpu.flops:
        fp8 = replace(req, inference=replace(req.inference, dtype="fp8", kv_dtype="fp8"))
        if _search(costs, cluster, fp8, {}).results:
            hints.append(f"{req.gpus} x {gpu.name} with --dtype fp8")
    if req.train:
        hints.append("a smaller --global-batch or --seq-len")
    return PlanError(detail + ("; it would fit on " + " or ".join(hints) if hints else ""))

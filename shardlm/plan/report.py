"""The plan as a table (rich, or plain text when stdout is not a terminal) and as JSON data."""

from __future__ import annotations

import json
import math

from shardlm.plan import constants as C
from shardlm.plan.explain import groups_across_nodes, placement_notes
from shardlm.plan.hardware import GIB
from shardlm.plan.memory import FIELDS

SHORT = {
    "weights": "wts",
    "kv_cache": "kv",
    "activations": "act",
    "gradients": "grad",
    "optimizer": "opt",
    "comm_buffers": "comm",
    "reserve": "rsv",
}


def _gb(x: float) -> str:
    return f"{x / GIB:.1f}"


def _ms(seconds: float) -> str:
    if math.isinf(seconds):
        return "unbounded"  # an arrival rate over the layout's capacity: the queue grows for ever
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 1 else f"{ms:.2f}"


def rows(plan) -> tuple[list[str], list[list[str]]]:
    train = plan.request.train
    head = ["#", "layout"]
    loaded = not train and plan.request.inference.loaded
    head += ["tokens/s", "MFU", "step s", "bubble"] if train else ["tok/s", "batch", "TTFT ms", "TPOT ms"]
    head += ["req/s", "p99 TTFT"] if loaded else []
    mem_fields = [f for f in FIELDS if any(getattr(r.memory, f) for r in plan.ranked[: plan.request.top])]
    head += [SHORT[f] for f in mem_fields] + ["GiB/GPU"]
    out = []
    for i, r in enumerate(plan.ranked[: plan.request.top], 1):
        row = [str(i), r.layout.label(train) + marks(plan, r)]
        if train:
            row += [
                f"{r.tokens_per_s:,.0f}",
                f"{r.mfu * 100:.0f}%",
                f"{r.step_s:.2f}",
                f"{r.bubble_fraction * 100:.1f}%",
            ]
        else:
            row += [f"{r.throughput:,.0f}", str(r.batch), _ms(r.ttft_s), _ms(r.tpot_s)]
            if loaded:
                row += [f"{r.serving.requests_per_s:,.2f}", _ms(r.serving.ttft_p99_s)]
        row += [_gb(getattr(r.memory, f)) for f in mem_fields] + [_gb(r.memory.total)]
        out.append(row)
    return head, out


def title(plan) -> str:
    req, c = plan.request, plan.cluster
    what = (
        f"training, global batch {req.training.global_batch} x {req.training.seq_len} tokens, {train_dtype(req.training)}"
        if req.train
        else f"inference, prompt {req.inference.prompt_len} + output {req.inference.output_len} tokens, "
        f"{req.inference.dtype}{load(req.inference)}"
    )
    return (
        f"{plan.model_name} on {c.num_gpus} x {c.gpu.name} ({c.num_nodes} node{'s' * (c.num_nodes > 1)} of "
        f"{c.gpus_per_node}); {what}; objective {req.objective}"
    )


def train_dtype(wl) -> str:
    """The training dtype, as the title names it: FP8 with the recipe its casts are priced by."""
    return f"{wl.dtype} (--fp8-recipe {wl.fp8_recipe or 'delayed'})" if wl.dtype == "fp8" else wl.dtype


def load(wl) -> str:
    """The serving load, as the title names it."""
    if wl.request_rate is not None:
        return f", Poisson arrivals at {wl.request_rate:g} requests/s"
    if wl.concurrency is not None:
        return f", {wl.concurrency} requests in flight"
    return ""


def serving_notes(plan) -> list[str]:
    """How the serving numbers were reached, and one line per shown layout a rate overloads."""
    if plan.request.train or not plan.request.inference.loaded:
        return []
    lines = [
        "TTFT/TPOT/throughput at that load (continuous batching, prompts in chunks of the "
        f"{C.PREFILL_CHUNK_TOKENS}-token step budget beside the decodes, queueing; batch = slots a replica)."
    ]
    for i, r in enumerate(plan.ranked[: plan.request.top], 1):
        s = r.serving
        if s.saturated:
            lines.append(
                f"#{i} {r.layout.label()}: {plan.request.inference.request_rate:g} requests/s is over its capacity of "
                f"{s.capacity_requests_per_s:,.2f}: the queue grows without bound (no finite TTFT)."
            )
    return lines


def split_notes(plan) -> list[str]:
    """With --prefill-replicas: each shown layout's two pools, the slower one and the KV handoff."""
    lines = []
    for i, r in enumerate(plan.ranked[: plan.request.top], 1):
        s = getattr(r, "split", None)
        if s is None:
            continue
        link = "NVLink, inside a node" if s.handoff_link == "node" else "the NIC, across nodes"
        lines.append(
            f"#{i} {r.layout.label()}: {s.prefill_replicas} prefill + {s.decode_replicas} decode replicas; capacity "
            f"{s.prefill_capacity_requests_per_s:,.2f} / {s.decode_capacity_requests_per_s:,.2f} requests/s "
            f"(prefill / decode: {s.bottleneck} limits); KV handoff {s.handoff_bytes / 2**20:,.1f} MiB a rank per "
            f"request, {_ms(s.handoff_s)} ms over {link} (after the first token: in TPOT)."
        )
    return lines


def attention_dp_notes(plan) -> list[str]:
    """Which shown layouts run attention data-parallel beside expert-parallel MoE layers (inference)."""
    if plan.request.train:
        return []
    moe = plan.cfg.is_moe
    shown = [f"#{i}" for i, r in enumerate(plan.ranked[: plan.request.top], 1) if r.layout.attention_dp(moe)]
    if not shown:
        return []
    return [
        f"Attention-DP ({', '.join(shown)}): each dp replica attends over its own sequences and holds only their KV "
        "cache; the MoE layers' experts span the replicas (tokens all-to-all at each), which step in lockstep."
    ]


def text(plan) -> str:
    head, body = rows(plan)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]

    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    lines = [title(plan), "", fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in body]
    s = plan.search
    lines += [
        "",
        f"memory in GiB per GPU; searched {s.evaluated:,} layouts in {s.seconds:.2f} s ({s.rate:,.0f}/s), "
        f"{len(plan.search.results):,} fit",
        "",
    ]
    return "\n".join(lines + notes(plan))


def notes(plan) -> list[str]:
    """The lines under the table: the load, the splits, the marks, placement, then the explanation."""
    return (
        serving_notes(plan)
        + split_notes(plan)
        + attention_dp_notes(plan)
        + runnable_notes(plan)
        + placement_notes(plan.ranked[: plan.request.top], plan.cluster)
        + plan.explanation
    )


def marks(plan, r) -> str:
    """A shown layout's marks: ``*`` not runnable by shardlm yet, ``~`` runs, but not as priced."""
    return (" *" if plan.not_runnable(r) else "") + (" ~" if plan.not_as_modelled(r) else "")


def runnable_notes(plan) -> list[str]:
    """One footnote per distinct reason a shown layout is marked (``marks``)."""
    shown = plan.ranked[: plan.request.top]
    refused = dict.fromkeys(w for r in shown if (w := plan.not_runnable(r)))
    unlike = dict.fromkeys(w for r in shown if (w := plan.not_as_modelled(r)))
    return [f"* not runnable by shardlm yet: {w}" for w in refused] + [
        f"~ runs slower in shardlm than shown, priced with {w}" for w in unlike
    ]


def print_table(plan, console=None) -> None:
    """Rich table on a terminal, plain text otherwise (pipes, tests)."""
    import sys

    if console is None and not sys.stdout.isatty():
        print(text(plan))
        return
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head, body = rows(plan)
    table = Table(title=title(plan), title_justify="left")
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i < 2 else "right")
    for r in body:
        table.add_row(*r)
    console.print(table)
    s = plan.search
    console.print(
        f"memory in GiB per GPU; searched {s.evaluated:,} layouts in {s.seconds:.2f} s ({s.rate:,.0f}/s), "
        f"{len(plan.search.results):,} fit"
    )
    for line in notes(plan):
        console.print(line)


def _num(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def to_data(plan) -> dict:
    req, train = plan.request, plan.request.train
    items = [_item(plan, r) for r in plan.ranked[: req.top]]
    c = plan.cluster
    out = {
        "model": plan.model_name,
        "gpu": c.gpu.name,
        "gpus": c.num_gpus,
        "gpus_per_node": c.gpus_per_node,
        "mode": "training" if train else "inference",
        "objective": req.objective,
        "workload": vars(req.training) if train else vars(req.inference),
        "searched": plan.search.evaluated,
        "search_seconds": plan.search.seconds,
        "fitting": len(plan.search.results),
        "layouts": items,
        "explanation": plan.explanation,
    }
    if req.compare is not None:  # the best with --compare's pins (fits: false when none fits)
        out["compared"] = None if plan.compared is None else {**_item(plan, plan.compared), "fits": plan.compared.fits}
    return out


def _item(plan, r) -> dict:
    """One ranked (or compared) layout as data."""
    train = plan.request.train
    d = {
        "layout": {**r.layout.sizes(), "label": r.layout.label(train)},
        "memory_bytes": r.memory.as_dict(),
        "rule_departures": plan.departures(r),
        "groups_across_nodes": groups_across_nodes(r.layout, plan.cluster),
        "not_runnable": plan.not_runnable(r),  # why shardlm cannot run it yet; None: it can
        "not_as_modelled": plan.not_as_modelled(r),  # the faster mechanism it is priced with that shardlm lacks
    }
    if train:
        lay = r.layout
        d["layout"].update(
            sp=lay.sp,
            zero=lay.zero,
            schedule=lay.schedule,
            virtual=lay.virtual,
            micro_batch=lay.micro_batch,
            num_micro=lay.num_micro,
            recompute=lay.recompute,
            cp_attention=lay.cp_attention,
        )
        d.update(
            tokens_per_s=r.tokens_per_s,
            step_s=r.step_s,
            mfu=r.mfu,
            bubble_fraction=r.bubble_fraction,
            comm_s=r.comm_s,
        )
    else:
        d.update(
            throughput_tokens_per_s=r.throughput,
            batch_per_replica=r.batch,
            max_batch=r.max_batch,
            ttft_s=_num(r.ttft_s),
            tpot_s=_num(r.tpot_s),
            latency_s=_num(r.latency_s),
            attention_dp=r.layout.attention_dp(plan.cfg.is_moe),
        )
        if r.serving is not None:  # at the workload's load (serving.py); null TTFTs: the queue grows for ever
            d["serving"] = {k: _num(v) for k, v in vars(r.serving).items()}
        if r.split is not None:  # --prefill-replicas: the two pools (disagg.py)
            pools = {
                k: {n: _num(x) for n, x in vars(v).items()} for k in ("prefill", "decode") if (v := getattr(r.split, k))
            }
            d["disaggregated"] = {
                **{k: v for k, v in vars(r.split).items() if k not in ("prefill", "decode")},
                "bottleneck": r.split.bottleneck,
                **pools,
            }
    return d


def to_json(plan) -> str:
    return json.dumps(to_data(plan), indent=2)

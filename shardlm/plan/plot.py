"""Pictures of a plan (matplotlib, Agg backend, PNG files):

* ``memory.png``: per-GPU memory of the top layouts, stacked by kind, against the device;
* ``schedule.png``: the chosen layout's pipeline timeline from ``schedule.simulate``
  (training: its schedule with the predicted forward/backward times; inference with pp > 1:
  decode micro-batches flowing through the stages; pp = 1: where a decode step's time goes).
"""

from __future__ import annotations

from pathlib import Path

from shardlm.plan.hardware import GIB
from shardlm.plan.memory import FIELDS
from shardlm.plan.schedule import simulate

MAX_PLOTTED_MICRO = 24
"""Timelines show at most this many micro-batches so the bars stay readable."""
COLORS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no display needed): every plot shardlm
    writes (plan, train --plot, bench comm --plot) draws with it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def memory_plot(plan, path: Path) -> Path:
    plt = pyplot()
    res = plan.ranked[: plan.request.top]
    labels = [r.layout.label(plan.request.train).replace(" ", "\n") for r in res]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(res)), 4.5 + 0.15 * max(x.count("\n") for x in labels)))
    bottom = [0.0] * len(res)
    for f in FIELDS:
        vals = [getattr(r.memory, f) / GIB for r in res]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=f.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.axhline(plan.cluster.gpu.memory_bytes / GIB, color="k", ls="--", lw=1, label="device memory")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{plan.model_name} on {plan.cluster.num_gpus} x {plan.cluster.gpu.name}: memory per GPU")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def schedule_plot(plan, path: Path) -> Path:
    plt = pyplot()
    best, lay = plan.best, plan.best.layout
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * max(lay.pp, 2)))
    if plan.request.train and lay.pp > 1:
        m = min(lay.num_micro, MAX_PLOTTED_MICRO)
        if lay.schedule == "interleaved":
            m -= m % lay.pp
        t_b, t_w = (best.backward_s / 2, best.backward_s / 2) if lay.schedule == "zb-h1" else (best.backward_s, 0.0)
        tl = simulate(
            lay.schedule,
            stages=lay.pp,
            micro=max(m, lay.pp if lay.schedule == "interleaved" else 1),
            t_f=best.forward_s,
            t_b=t_b,
            t_w=t_w,
            virtual=lay.virtual,
        )
        title = (
            f"{lay.schedule} schedule, {lay.pp} stages, {tl.micro} of {lay.num_micro} micro-batches: "
            f"bubble {tl.bubble_fraction * 100:.1f}%"
        )
    elif lay.pp > 1:
        stage_t = best.tpot_s / lay.pp
        tl = simulate("gpipe", stages=lay.pp, micro=lay.pp * 2, t_f=stage_t, t_b=0.0)
        title = f"decode: {lay.pp} micro-batches in flight through {lay.pp} stages (two steps shown)"
    else:
        tl = None
    if tl is not None:
        for e in tl.events:
            if e.end > e.start:
                ax.barh(e.stage, e.end - e.start, left=e.start, color=COLORS[e.kind], edgecolor="white", lw=0.5)
                if tl.micro <= 12:
                    ax.text(
                        (e.start + e.end) / 2,
                        e.stage,
                        str(e.micro),
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white",
                    )
        ax.set_yticks(range(tl.stages), [f"stage {s}" for s in range(tl.stages)])
        ax.invert_yaxis()
        ax.set_xlabel("seconds")
        handles = [
            plt.Rectangle((0, 0), 1, 1, color=c)
            for k, c in COLORS.items()
            if any(e.kind == k and e.end > e.start for e in tl.events)
        ]
        names = [k for k in COLORS if any(e.kind == k and e.end > e.start for e in tl.events)]
        ax.legend(handles, names, fontsize=8, loc="upper right")
    else:  # one stage: where the step's time goes
        if plan.request.train:
            parts = {
                "forward": best.forward_s * lay.num_micro,
                "backward": best.backward_s * lay.num_micro,
                **{f"{k} comm": v for k, v in (best.comm_s or {}).items() if v},
            }
            title = f"one training step ({lay.num_micro} micro-batches, no pipeline)"
        else:
            d = best.decode_parts
            parts = {
                "matmuls": d.matmul,
                "attention": d.attention,
                "TP comm": d.tp_comm,
                "EP comm": d.ep_comm,
                "CP comm": d.cp_comm,
                "LM head": d.head,
            }
            title = "one decode step (no pipeline)"
        left = 0.0
        for name, v in parts.items():
            if v > 0:
                ax.barh(0, v, left=left, label=name)
                left += v
        ax.set_yticks([])
        ax.set_xlabel("seconds")
        ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"{lay.label(plan.request.train)}: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(plan, directory: str | Path) -> list[Path]:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    return [memory_plot(plan, d / "memory.png"), schedule_plot(plan, d / "schedule.png")]

"""Tables and plots of a ``CommReport``: one table per op, one column group per backend,
and the ratio of the first backend's time to every other's (the peer in the same run)."""

from __future__ import annotations

import os


def human(nbytes: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % size == 0:
            return f"{nbytes // size}{unit}"
    return str(nbytes)


def comm_table(report) -> str:
    backends = list(report.paths)
    label = {b: b if report.paths[b] == b else f"{b}={report.paths[b]}" for b in backends}
    lines = [
        f"{report.ranks} ranks, {report.dtype}; load average {report.load_before[0]:.2f} before, "
        f"{report.load_after[0]:.2f} after"
    ]
    if report.memcpy_GBps:
        lines.append(f"memcpy (one torch copy, one rank's threads): {report.memcpy_GBps:.2f} GB/s")
    if report.why_not_shm:
        lines.append(f"shared memory not used: {report.why_not_shm}")
    by = {(r["op"], r["backend"], r["bytes"]): r for r in report.rows}
    for op in dict.fromkeys(r["op"] for r in report.rows):
        sizes = sorted({r["bytes"] for r in report.rows if r["op"] == op})
        head = f"{'bytes':>8}"
        for b in backends:
            head += f" | {label[b] + ' us':>12} {'algbw':>7} {'busbw':>7}"
        for b in backends[1:]:
            head += f" | {b + '/' + backends[0]:>10}"
        head += " | ok"
        lines += ["", f"{op} (GB/s)", head, "-" * len(head)]
        for s in sizes:
            row = by[(op, backends[0], s)]
            line = f"{human(s):>8}"
            for b in backends:
                r = by[(op, b, s)]
                line += f" | {r['time_us']:>12.1f} {r['algbw']:>7.3f} {r['busbw']:>7.3f}"
            for b in backends[1:]:
                line += f" | {by[(op, b, s)]['time_us'] / row['time_us']:>9.1f}x"
            line += " | " + ("yes" if all(by[(op, b, s)]["ok"] for b in backends) else "WRONG")
            lines.append(line)
    if report.memcpy_GBps:
        lines += ["", "largest message, busbw / memcpy bandwidth:"]
        top = max(r["bytes"] for r in report.rows)
        for r in report.rows:
            if r["bytes"] == top:
                lines.append(f"  {r['op']:<15} {label[r['backend']]:<10} {r['busbw'] / report.memcpy_GBps:6.1%}")
    return "\n".join(lines)


def comm_plots(report, directory: str) -> list[str]:
    """latency.png and busbw.png (one line per op and backend, log-log); returns the paths."""
    from shardlm.plan.plot import pyplot

    plt = pyplot()
    os.makedirs(directory, exist_ok=True)
    paths = []
    for key, ylabel, name in (
        ("time_us", "time per call (us)", "latency.png"),
        ("busbw", "bus bandwidth (GB/s)", "busbw.png"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for op in dict.fromkeys(r["op"] for r in report.rows):
            for b, path in report.paths.items():
                pts = sorted((r["bytes"], r[key]) for r in report.rows if r["op"] == op and r["backend"] == b)
                style = "-" if path == "shm" else "--"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker=".", label=f"{op} ({path})")
        if key == "busbw" and report.memcpy_GBps:
            ax.axhline(report.memcpy_GBps, color="gray", linestyle=":", label="memcpy")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"shardlm bench comm: {report.ranks} ranks, {report.dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        out = os.path.join(directory, name)
        fig.savefig(out, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(out)
    return paths

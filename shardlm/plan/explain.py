"""Why the winner wins: placement rules, tie-breaking by them, and the short explanation.

The rules are the field's defaults (Narayanan et al. 2021, https://arxiv.org/abs/2104.04473
§3 "takeaways"; the Llama 3 paper, https://arxiv.org/abs/2407.21783 §3.3.1): tensor parallelism
inside a node, pipeline parallelism across nodes, expert parallelism for MoE layers, data
parallelism for more requests per second, context / sequence parallelism for long contexts.
The planner follows a rule unless its numbers say otherwise by more than NEAR_TIE_FRACTION,
and then it says so.
"""

from __future__ import annotations

from shardlm.plan import constants as C
from shardlm.plan.comm import placement
from shardlm.plan.hardware import gib

CHATTY_GROUPS = ("tp", "cp", "ep", "etp")
"""Groups that talk inside every layer; one that leaves its node pays the NIC there."""

LONG_CONTEXT_TOKENS = 32768
"""Contexts from this length on count as long (CP/SP territory; Llama 3 §3.3.1 switches CP on
for its 128K stage)."""


def departures(res, ctx) -> list[str]:
    """The rules a result's layout breaks, each as one short phrase."""
    lay, cluster, cfg = res.layout, ctx["cluster"], ctx["cfg"]
    out = []
    _, tp_nodes = placement(lay.slowest_group("tp", cluster.gpus_per_node), cluster)
    if tp_nodes > 1:
        out.append("TP inside a node")
    replica_nodes = placement(lay.replica_ranks()[0], cluster)[1]
    if replica_nodes > 1 and lay.pp == 1:
        out.append("PP across nodes")
    if cfg.is_moe and lay.ep == 1 and lay.dp * lay.tp > 1:
        out.append("EP for MoE")
    # a model replica: the ranks that split one copy of the weights (training's CP ranks hold
    # copies of the same weights and sync gradients like DP ranks; inference's CP ranks serve one request)
    replicas = lay.dp * lay.cp if ctx["train"] else lay.dp
    if ctx["objective"] == "throughput" and replicas == 1 and ctx.get("min_replica", lay.world_size) < lay.world_size:
        out.append("DP for throughput")
    long = ctx["context_len"] >= LONG_CONTEXT_TOKENS
    if long and lay.cp == 1 and not lay.sp:
        out.append("CP/SP for long context")
    if not long and lay.cp > 1:
        out.append("CP only for long context")
    if ctx["train"] and lay.tp > 1 and not lay.sp:
        out.append("SP with TP")
    return out


def groups_across_nodes(lay, cluster) -> dict[str, int]:
    """{group kind: nodes its slowest group spans} for the per-layer groups that leave their node."""
    spans = {k: lay.nodes_spanned(k, cluster.gpus_per_node) for k in CHATTY_GROUPS if getattr(lay, k) > 1}
    return {k: n for k, n in spans.items() if n > 1}


def placement_notes(results: list, cluster) -> list[str]:
    """One line per shown layout whose per-layer groups cross nodes (their collectives are costed
    on the inter-node link)."""
    out = []
    for i, r in enumerate(results, 1):
        if crossing := groups_across_nodes(r.layout, cluster):
            what = ", ".join(f"its {k} group spans {n} nodes" for k, n in crossing.items())
            out.append(f"#{i} {r.layout.label()}: {what} (costed on the inter-node link).")
    return out


def score(res, objective: str) -> float:
    if objective == "latency":  # (hasattr, not `or`: a 0 output tokens/s is a score too)
        return -(res.latency_s if hasattr(res, "latency_s") else res.step_s)
    return res.throughput if hasattr(res, "throughput") else res.tokens_per_s


def rerank(results: list, ctx: dict) -> list:
    """Among layouts within NEAR_TIE_FRACTION of the best, prefer the fewest rule departures."""
    if not results:
        return results
    fitting_sizes = [r.layout.tp * r.layout.pp * (1 if ctx["train"] else r.layout.cp) for r in results]
    ctx["min_replica"] = min(fitting_sizes)
    best = score(results[0], ctx["objective"])
    span = abs(best) * C.NEAR_TIE_FRACTION
    ties = [r for r in results if abs(score(r, ctx["objective"]) - best) <= span]
    if getattr(results[0], "serving", None) is not None:  # at a load, a tie is one in latency too
        ties = [r for r in ties if r.latency_s <= results[0].latency_s * (1 + C.NEAR_TIE_FRACTION)]
    ties.sort(key=lambda r: len(departures(r, ctx)))
    rest = [r for r in results if r not in ties]
    return ties + rest


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f}%" if b else "n/a"


def explain(results: list, ctx: dict) -> list[str]:
    """A few sentences: what limits the winner, what the runner-up trades, which rules hold."""
    if not results:
        return []
    win = results[0]
    lines = []
    train = ctx["train"]
    if train:
        lines.append(
            f"{win.layout.label(True)} wins at {win.tokens_per_s:,.0f} tokens/s ({win.mfu * 100:.0f}% MFU): "
            f"pipeline bubble {win.bubble_fraction * 100:.1f}%, per-GPU memory {gib(win.memory.total)} of "
            f"{gib(ctx['cluster'].gpu.memory_bytes)}."
        )
        comm = {k: v for k, v in (win.comm_s or {}).items() if v > 0}
        if comm:
            top = max(comm, key=lambda k: comm[k])
            lines.append(f"Its largest communication cost is {top} ({comm[top] / win.step_s * 100:.0f}% of the step).")
    else:
        parts = win.decode_parts
        total = parts.total or 1.0
        shares = {
            "weight/KV traffic and matmuls": parts.matmul + parts.attention,
            "TP all-reduces": parts.tp_comm,
            "EP all-to-alls": parts.ep_comm,
            "CP merges": parts.cp_comm,
            "LM head and logits": parts.head,
        }
        top = max(shares, key=lambda k: shares[k])
        lead = (
            f"{win.latency_s * 1e3:,.0f} ms per request ({win.throughput:,.0f} output tokens/s)"
            if ctx["objective"] == "latency"
            else f"{win.throughput:,.0f} output tokens/s"
        )
        batch = f"batch {win.batch}"
        if win.serving is not None:  # at a load: the requests at work, of the slots
            batch = f"{win.serving.running:,.1f} of {win.batch} slots busy"
        lines.append(
            f"{win.layout.label()} wins: {lead} at {batch} per replica, "
            f"TTFT {win.ttft_s * 1e3:.0f} ms, TPOT {win.tpot_s * 1e3:.1f} ms; a decode step is "
            f"{shares[top] / total * 100:.0f}% {top}."
        )
        lines.append(
            f"Per GPU: {gib(win.memory.weights)} weights leave room for {win.max_batch} sequences of KV cache "
            f"({gib(win.memory.kv_cache)} used)."
        )
    if len(results) > 1:
        ru = results[1]
        if train:
            lines.append(
                f"Runner-up {ru.layout.label(True)}: {_pct(ru.tokens_per_s, win.tokens_per_s)} tokens/s, "
                f"memory {gib(ru.memory.total)} vs {gib(win.memory.total)}, bubble {ru.bubble_fraction * 100:.1f}%."
            )
        elif ctx["objective"] == "latency":
            lines.append(
                f"Runner-up {ru.layout.label()}: {_pct(ru.latency_s, win.latency_s)} latency "
                f"({ru.latency_s * 1e3:,.0f} ms vs {win.latency_s * 1e3:,.0f} ms per request), "
                f"TPOT {ru.tpot_s * 1e3:.1f} ms vs {win.tpot_s * 1e3:.1f} ms, TTFT {ru.ttft_s * 1e3:.0f} ms vs "
                f"{win.ttft_s * 1e3:.0f} ms, weights {gib(ru.memory.weights)} vs {gib(win.memory.weights)} per GPU."
            )
        else:
            lines.append(
                f"Runner-up {ru.layout.label()}: {_pct(ru.throughput, win.throughput)} throughput, "
                f"TPOT {ru.tpot_s * 1e3:.1f} ms vs {win.tpot_s * 1e3:.1f} ms, TTFT {ru.ttft_s * 1e3:.0f} ms vs "
                f"{win.ttft_s * 1e3:.0f} ms, batch {ru.batch} vs {win.batch}, weights {gib(ru.memory.weights)} vs "
                f"{gib(win.memory.weights)} per GPU."
            )
    if len(results) > 1 and departures(results[1], ctx):
        lines[-1] = lines[-1].rstrip(".") + f"; it breaks '{', '.join(departures(results[1], ctx))}'."
    top = max(results, key=lambda r: score(r, ctx["objective"]))
    if top is not win:
        lines.append(
            f"{top.layout.label(train)} scores {_pct(score(top, ctx['objective']), score(win, ctx['objective']))} "
            f"but breaks more placement rules ({', '.join(departures(top, ctx)) or 'none'}); within the "
            f"{C.NEAR_TIE_FRACTION * 100:.0f}% the model cannot resolve, the rule-following layout is preferred."
        )
    broken = departures(win, ctx)
    if not broken:
        lines.append(
            "It follows the usual rules (TP inside a node, PP across nodes, EP for MoE, DP for throughput, "
            "CP/SP only for long context)."
        )
    for rule in broken:
        follower = next((r for r in results if rule not in departures(r, ctx)), None)
        if follower is None:
            lines.append(f"Rule '{rule}' cannot be followed here: no fitting layout does.")
        else:
            gap = (
                _pct(score(follower, ctx["objective"]), score(win, ctx["objective"]))
                if ctx["objective"] != "latency"
                else _pct(-score(follower, "latency"), -score(win, "latency")) + " latency"
            )
            lines.append(
                f"It departs from '{rule}' because the numbers say so: the best layout that follows it, "
                f"{follower.layout.label(train)}, scores {gap}."
            )
    return lines


def compare(win, other, ctx: dict, pins: str) -> list[str]:
    """Sentences setting the pick beside ``other``, the best layout with the user's ``pins``
    (``--compare``): by how much one wins and, in numbers, where the difference comes from."""
    if other is None:
        return [f"Nothing with {pins} was found on this cluster (the pins leave no layout to search)."]
    train, label = ctx["train"], other.layout.label(ctx["train"])
    if not other.fits:
        m = other.memory
        return [
            f"Compared: {label} (the closest with {pins}) does not fit: {gib(m.total)} per GPU of "
            f"{gib(ctx['cluster'].gpu.memory_bytes)} (weights {gib(m.weights)}, activations {gib(m.activations)}, "
            f"gradients {gib(m.gradients)}, optimizer {gib(m.optimizer)}, KV cache {gib(m.kv_cache)})."
        ]
    if other.layout == win.layout:
        return [f"Compared: {label}, the best with {pins}, is the pick itself."]
    if train:
        parts = [f"bubble {other.bubble_fraction * 100:.1f}% vs {win.bubble_fraction * 100:.1f}%"]
        for k in sorted(set(other.comm_s or {}) | set(win.comm_s or {})):
            a, b = (other.comm_s or {}).get(k, 0.0), (win.comm_s or {}).get(k, 0.0)
            if max(a, b) > 0.01 * win.step_s:
                parts.append(f"{k} communication {a:.2f} s vs {b:.2f} s")
        parts.append(
            f"forward + backward {other.forward_s + other.backward_s:.3f} s vs {win.forward_s + win.backward_s:.3f} s a micro-batch"
        )
        parts.append(f"memory {gib(other.memory.total)} vs {gib(win.memory.total)} per GPU")
        return [
            f"Compared: {label} (the best with {pins}): {_pct(other.tokens_per_s, win.tokens_per_s)} tokens/s "
            f"({other.tokens_per_s:,.0f} vs {win.tokens_per_s:,.0f}), step {other.step_s:.2f} s vs {win.step_s:.2f} s: "
            + ", ".join(parts)
            + "."
        ]
    return [
        f"Compared: {label} (the best with {pins}): {_pct(other.throughput, win.throughput)} throughput "
        f"({other.throughput:,.0f} vs {win.throughput:,.0f} output tokens/s), latency {other.latency_s * 1e3:,.0f} ms "
        f"vs {win.latency_s * 1e3:,.0f} ms per request, TPOT {other.tpot_s * 1e3:.1f} ms vs {win.tpot_s * 1e3:.1f} ms, "
        f"TTFT {other.ttft_s * 1e3:.0f} ms vs {win.ttft_s * 1e3:.0f} ms, batch {other.batch} vs {win.batch} per "
        f"replica, weights {gib(other.memory.weights)} vs {gib(win.memory.weights)} per GPU."
    ]

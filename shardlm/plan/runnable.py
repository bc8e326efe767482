"""Which ranked layouts shardlm itself can run today.

The planner searches every layout the literature offers; the ones shardlm's engine or trainer
refuse are kept in the ranking (they show what the hardware could do) but marked with the
refusal's reason, and the explanation names the best layout that does run. Each rule below
mirrors a refusal in the code named beside it; change both together. Layouts priced with a
faster mechanism shardlm lacks (``not_as_modelled``) run, but slower than ranked: they are
marked apart."""

from __future__ import annotations

import itertools

from shardlm.models.config import DEEPSEEK, RUNTIME_FAMILIES
from shardlm.parallel.expert import experts_span_replicas
from shardlm.parallel.tensor import partition_heads
from shardlm.plan.comm import moe_boundary
from shardlm.plan.layout import Layout
from shardlm.plan.training import ep_overlaps, pp_overlaps


def not_runnable(cfg, lay: Layout, *, train: bool, dtype: str, prefill_replicas: int = 0, mtp: int = 0) -> str | None:
    """Why shardlm cannot run ``lay`` for ``cfg`` yet (None: it can); ``prefill_replicas``: served
    disaggregated (``serve --prefill-replicas``); ``mtp``: trained with multi-token-prediction modules."""
    if cfg.family not in RUNTIME_FAMILIES:  # models/config.py check_supported
        return f"the {cfg.family} architecture (shardlm runs {', '.join(RUNTIME_FAMILIES)})"
    if train:
        if mtp:  # train/loss.py: the next token's cross-entropy only
            return f"{mtp} multi-token-prediction module(s) (--mtp; shardlm's trainer predicts the next token only)"
        if lay.sp and (cfg.is_moe or cfg.is_mla):  # models/transformer.py
            return "sequence parallelism with MoE or latent-attention layers"
        if lay.cp > 1 and cfg.is_mla:  # train/trainer.py check_trainable
            return "context parallelism with latent attention"
        if lay.schedule == "interleaved" and cfg.num_layers % (lay.pp * lay.virtual):  # parallel/schedules.py
            return f"interleaving {cfg.num_layers} layers in pp x vpp = {lay.pp * lay.virtual} uneven chunks"
        if cfg.family in DEEPSEEK and dtype != "fp32":  # train/trainer.py check_trainable
            return f"{cfg.family} in {dtype}: shardlm trains it in float32 (its router and ZeRO units)"
        parts = [partition_heads(cfg.num_heads, cfg.num_kv_heads, lay.tp, r) for r in range(lay.tp)]
        if any(a.kv.stop > b.kv.start for a, b in itertools.pairwise(parts)):  # check_trainable
            return f"tp={lay.tp} splits a KV head's query group over two ranks (training sums no gradients across them)"
        return None
    if lay.cp > 1 and cfg.is_mla:  # engine/config.py for_model
        return "context parallelism with latent attention (its cache is not striped yet)"
    if dtype == "fp8":  # engine/config.py DTYPES
        return "fp8 weights and GEMMs: shardlm computes in bf16, fp16 or fp32 (int8 weight-only)"
    return split_refused(cfg, lay) if prefill_replicas else None


def not_as_modelled(cfg, lay: Layout, work, *, train: bool, cluster) -> str | None:
    """The faster mechanism ``work`` prices ``lay`` with that shardlm lacks, so that it runs the
    layout slower than ranked (None: as priced): a peer's, pinned to compare with a published run
    (``--zero3-reduce overlapped``, ``--tp-overlap``, ``--grad-reduce bf16``, ``--pp-overlap``, ``--ep-overlap``,
    ``--recompute-modules``, ``--dispatcher deepep``, ``--kernels fused``)."""
    if train and lay.zero == 3 and work.zero3_reduce == "overlapped":  # train/zero.py reduces in backward
        return "ZeRO-3's reduce-scatters behind backward (--zero3-reduce overlapped; shardlm's wait in backward)"
    if train and lay.tp > 1 and lay.sp and work.tp_overlap:  # parallel/tensor.py waits for each collective
        return "TP collectives pipelined with the GEMMs (--tp-overlap; shardlm's trainer waits for each)"
    if train and lay.dp * lay.cp > 1 and work.grad_reduce == "bf16":  # train/unit.py full_grad: float32
        return "16-bit gradient reductions (--grad-reduce bf16; shardlm's trainer reduces in float32)"
    if train and pp_overlaps(lay, work):  # train/schedule.py: each receive blocks
        return (
            "the pipeline's hops behind the chunks beside them (--pp-overlap; shardlm's trainer waits for each receive)"
        )
    if train and ep_overlaps(cfg, lay, work):  # parallel/expert.py: each trip waited for
        return "the all-to-alls behind another micro-batch (--ep-overlap; shardlm's trainer waits for each)"
    if train and work.recompute_modules and lay.recompute != "full":  # train/trainer.py: none, selective or full
        return f"{','.join(work.recompute_modules)} recomputed (--recompute-modules; shardlm's trainer keeps them)"
    if work.dispatcher == "deepep" and cfg.is_moe and dispatch_priced_apart(cfg, lay, cluster):  # parallel/expert.py
        return "DeepEP's token-based dispatch (--dispatcher deepep; shardlm sends every (token, expert) pair)"
    if train and work.kernels == "fused":  # traffic.py: shardlm's eager kernels' bytes
        return "fused memory-bound kernels (--kernels fused; shardlm's trainer runs eager ones)"
    return None


def dispatch_priced_apart(cfg, lay: Layout, cluster) -> bool:
    """Whether DeepEP's dispatch prices this layout's token trip apart from shardlm's (any trip between
    ep ranks): derived from ``comm.moe_boundary`` itself, at any token count."""
    return moe_boundary(cfg, cluster, lay, 1.0, 2.0, "deepep") != moe_boundary(cfg, cluster, lay, 1.0, 2.0)


def split_refused(cfg, lay: Layout) -> str | None:
    """Why shardlm's engine will not split ``lay``'s replicas into prefill and decode pools (None: it will)."""
    if lay.cp > 1:  # engine/config.py _check_cp
        return "prefill replicas with cp (a handoff would move a cache striped over cp ranks)"
    if cfg.is_moe and experts_span_replicas(lay.tp, lay.ep, lay.etp):  # engine/llm.py
        return "prefill replicas with experts spanning replicas (those replicas step in lockstep)"
    return None

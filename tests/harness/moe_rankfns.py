"""Rank functions for the MoE tests (module level, so pool ranks can import them).

``dp_greedy_and_logits`` runs the model on one rank of a tp x dp layout with expert
parallelism, the way DP attention will: each dp rank serves its own prompts (possibly
none) and every rank takes the same number of steps, a rank without work calling
``idle_forward`` so it still joins the expert collectives. It drives ``Transformer``
directly with a minimal paged-KV loop (contiguous blocks per sequence), independent of
the engine's scheduler.
"""

from __future__ import annotations

import torch

from harness.multirank import dims as built_dims

BLOCK = 16


def _layout(tp: int, dp: int, ep: int, etp: int = 1):
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        return built_dims(tp=tp, dp=dp, ep=ep, etp=etp)
    from shardlm.parallel.dims import ParallelDims

    return ParallelDims(tp=tp, dp=dp, ep=ep, etp=etp).build_mesh("cpu")


class MiniRunner:
    """Prefill a batch of prompts, then decode them together; greedy; contiguous KV blocks."""

    def __init__(self, model, max_len: int, num_seqs: int):
        from shardlm.models.attention import AttentionMetadata, PrefillSeq

        self.model, self.meta_cls, self.prefill_cls = model, AttentionMetadata, PrefillSeq
        self.per_seq = -(-max_len // BLOCK)
        planes, heads, row = model.layers[0].attn.cache_layout()
        shape = (planes, self.per_seq * max(num_seqs, 1), BLOCK, heads, row)
        dtype = model.layers[0].post_norm.weight.dtype
        self.caches = [torch.zeros(shape, dtype=dtype) for _ in model.layers]

    def table(self, i: int) -> list[int]:
        return list(range(i * self.per_seq, (i + 1) * self.per_seq))

    def slot(self, i: int, pos: int) -> int:
        return self.table(i)[pos // BLOCK] * BLOCK + pos % BLOCK

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], all_positions: bool = False) -> torch.Tensor:
        meta = self.meta_cls(slot_mapping=None, block_size=BLOCK)
        ids, pos, slots, last = [], [], [], []
        for i, p in enumerate(prompts):
            meta.prefills.append(
                self.prefill_cls(
                    start=len(ids), length=len(p), context_len=len(p), block_table=torch.tensor(self.table(i))
                )
            )
            ids += p
            pos += range(len(p))
            slots += [self.slot(i, j) for j in range(len(p))]
            last.append(len(ids) - 1)
        meta.num_prefill_tokens = len(ids)
        meta.slot_mapping = torch.tensor(slots)
        rows = None if all_positions else torch.tensor(last)
        return self.model(torch.tensor(ids), torch.tensor(pos), meta, self.caches, rows).float()

    @torch.inference_mode()
    def decode(self, tokens: list[int], lengths: list[int]) -> torch.Tensor:
        """One new token per sequence; lengths = context length after this token."""
        n = len(tokens)
        meta = self.meta_cls(
            slot_mapping=torch.tensor([self.slot(i, lengths[i] - 1) for i in range(n)]), block_size=BLOCK
        )
        meta.decode_block_tables = torch.tensor([self.table(i) for i in range(n)])
        meta.decode_context_lens = torch.tensor(lengths)
        meta.decode_max_context = max(lengths)
        pos = torch.tensor([x - 1 for x in lengths])
        return self.model(torch.tensor(tokens), pos, meta, self.caches, torch.arange(n)).float()


def greedy(runner: MiniRunner, prompts: list[list[int]], new_tokens: int, idle) -> list[list[int]]:
    """new_tokens greedy tokens per prompt; with no prompts, ``idle()`` once per step instead."""
    if not prompts:
        for _ in range(new_tokens):
            idle()
        return []
    out = [[t] for t in runner.prefill(prompts).argmax(-1).tolist()]
    lengths = [len(p) for p in prompts]
    for _ in range(new_tokens - 1):
        lengths = [x + 1 for x in lengths]
        step = runner.decode([o[-1] for o in out], lengths).argmax(-1).tolist()
        for o, t in zip(out, step):
            o.append(t)
    return out


def dp_greedy_and_logits(
    path: str,
    tp: int,
    dp: int,
    ep: int,
    prompts: list[list[int]],
    assignment: list[list[int]],
    new_tokens: int,
    etp: int = 1,
):
    """On every rank: ({prompt index: greedy tokens}, {prompt index: logits [len, vocab]},
    expert-weight elements held, dispatch path). assignment[d] = prompt indices of dp rank d."""
    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.models.moe import idle_forward, moe_blocks

    dims = _layout(tp, dp, ep, etp)
    model = load_model(open_checkpoint(path), dims)
    mine = assignment[dims.dp_rank]
    max_len = max(len(prompts[i]) for i in range(len(prompts))) + new_tokens
    runner = MiniRunner(model, max_len, len(mine))
    tokens = dict(zip(mine, greedy(runner, [prompts[i] for i in mine], new_tokens, lambda: idle_forward(model))))
    logits = {}
    for r in range(max(len(a) for a in assignment)):  # one prompt per round; idle ranks join
        if r < len(mine):
            logits[mine[r]] = runner.prefill([prompts[mine[r]]], all_positions=True)
        else:
            idle_forward(model)
    blocks = moe_blocks(model)
    held = sum(b.experts.w13.numel() + b.experts.w2.numel() for b in blocks)
    return tokens, logits, held, blocks[0].experts.dispatch if blocks else None


def _block(path: str, layer: int, dims, **kw):
    from shardlm.models.loader import open_checkpoint
    from shardlm.models.moe import SparseMoE

    ckpt = open_checkpoint(path)
    src = ckpt.source()
    block = SparseMoE(ckpt.config, dims, f"model.layers.{layer}", torch.float32, **kw)
    for m in block.modules():
        if hasattr(m, "load"):
            m.load(src)
    return block.eval(), src


def _my_tokens(x: torch.Tensor, counts: list[int], dp_rank: int) -> torch.Tensor:
    start = sum(counts[:dp_rank])
    return x[start : start + counts[dp_rank]]


def block_outputs(path: str, layer: int, x: torch.Tensor, layouts: list[dict]) -> list:
    """For each layout {tp, dp, ep, etp, counts, dispatch}: (dispatch path taken, this rank's
    output for its dp rank's tokens). counts[d] = tokens of dp rank d (0: an idle rank)."""
    out = []
    for spec in layouts:
        spec = dict(spec)
        counts, dispatch = spec.pop("counts"), spec.pop("dispatch", "auto")
        dims = _layout(**spec)
        block, _ = _block(path, layer, dims, dispatch=dispatch)
        with torch.inference_mode():
            y = block(_my_tokens(x, counts, dims.dp_rank))
        out.append((block.experts.dispatch, y))
    return out


def eplb_round_trip(path: str, layer: int, x: torch.Tensor, spec: dict, redundant: int):
    """Outputs and collected load before and after EPLB re-places the experts from that load."""
    from shardlm.parallel.expert_stats import collect_load, rebalance_experts

    spec = dict(spec)
    counts = spec.pop("counts")
    dims = _layout(**spec)
    block, src = _block(path, layer, dims)
    mine = _my_tokens(x, counts, dims.dp_rank)
    with torch.inference_mode():
        before = block(mine)
        load_before = collect_load(block, dims)
        rebalance_experts(block, load_before, src, redundant=redundant)
        after = block(mine)
        load_after = collect_load(block, dims)
    return before, after, load_before, load_after, block.experts.placement


def read_and_held(path: str, tp: int, dp: int, ep: int, etp: int = 1):
    """(elements this rank read from the checkpoint, elements of its parameters that come
    from the checkpoint, expert-weight elements it holds, the logical experts of its slots
    per MoE layer)."""
    from shardlm.models.loader import CountingSource, load_model, open_checkpoint
    from shardlm.models.moe import moe_blocks

    ckpt = open_checkpoint(path)
    source = CountingSource(ckpt.source())
    model = load_model(ckpt, _layout(tp, dp, ep, etp), source=source)
    blocks = moe_blocks(model)
    held = sum(b.experts.w13.numel() + b.experts.w2.numel() for b in blocks)
    params = sum(p.numel() for p in model.parameters())
    params += sum(b.router.bias.numel() for b in blocks if b.router.bias is not None)  # DeepSeek-V3's buffer
    return source.elements, params, held, [b.experts.local_experts for b in blocks]

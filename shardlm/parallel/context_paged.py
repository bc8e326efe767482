"""Context parallelism at inference: each sequence's tokens and its KV cache striped over the cp ranks.

Layout. The cache is striped by block: a sequence's positions come in runs of ``block_size`` tokens,
run j held by cp rank j % cp, so rank r holds positions p with (p // block_size) % cp == r. The block
manager hands out *group blocks* of cp x block_size tokens, one physical block on every cp rank
(rank r's holds the group block's r-th run), so a request is admitted when the cp group together has
room, a prefix hit is a group block, and every rank holds 1/cp of every long context (within one
run). Striping, rather than training's two zig-zag chunks, balances a causal prefill for any length
and keeps a token's place fixed as the sequence grows (striped attention, Brandon et al. 2023,
https://arxiv.org/abs/2311.09431, with stripes of a block).

A step's tokens are computed where their K/V is kept: each rank runs the model on the tokens it owns.
Attention passes the queries, never the cache (pass-Q, as Yang et al. 2024 decode and prefill with a
warm cache, https://arxiv.org/abs/2411.01783): the step's queries are all-gathered, every rank
attends all of them to the keys it holds (its cached blocks and the step's own new keys), and the
partial outputs return to the queries' owners by an all-to-all, where they merge by their
log-sum-exp (the online softmax of flash and ring attention). One path serves prefill, chunked
prefill, prefix hits and decode, and the cache never moves. Per layer and step a rank sends its
queries (tokens x q_heads x head_dim) and receives the partial outputs of its own (tokens x q_heads x
(head_dim + 1)) from every other rank.

With ``cp_attention="ulysses"`` a *fresh* prefill (a whole prompt in one step, nothing cached before
it) takes DeepSpeed-Ulysses' path instead (Jacobs et al. 2023, https://arxiv.org/abs/2309.14509): an
all-to-all gives each rank every token of the prompt for 1/cp of the heads, causal attention runs
there as one fused kernel, and a second all-to-all brings each rank its own tokens' outputs for every
head; the keys and values still go to the striped cache where their owners hold them. Steps with a
cached context (later chunks, prefix hits, decode) keep pass-Q, which needs the cache.

With ``cp_attention="ring"`` a fresh prefill takes ring attention's path instead (Liu et al. 2023,
https://arxiv.org/abs/2310.01889, over the striped layout of Brandon et al. 2023): each rank keeps
the queries of the tokens it owns, and the keys and values of the step's fresh tokens travel around
the cp ring, cp - 1 hops, the next block in flight while the current one is attended
(``context.ring_blocks``, the training ring's pass). Each block is attended under the causal mask of
its tokens' positions (and the window) and the partial outputs merge by log-sum-exp as they come. A
rank moves the K/V heads of its own tokens (never expanded for GQA) each hop, and gathers nothing.
Steps with a cached context keep pass-Q here too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch
from torch import Tensor

from shardlm.parallel.comm import ProcessGroup, all_gather, all_reduce, all_to_all, group_size
from shardlm.parallel.context import causal_attention, masked_scores, ring_blocks, ulysses_units


def owner(position: int, block_size: int, cp: int) -> int:
    """The cp rank that holds (and computes) the token at ``position``."""
    return (position // block_size) % cp


def local_key_positions(blocks: int, block_size: int, cp: int, rank: int, device=None) -> Tensor:
    """[blocks * block_size]: the positions rank ``rank`` holds in a sequence's first ``blocks``
    group blocks, in the order its physical blocks store them."""
    group = torch.arange(blocks, device=device)[:, None] * (block_size * cp)
    return (group + rank * block_size + torch.arange(block_size, device=device)[None, :]).flatten()


@dataclass
class ContextShards:
    """One inference step under cp: which rank holds which of the step's tokens, and the
    collectives that bring the queries together and the outputs home.

    ``order[i]``: the step row (tokens flattened in the batch's order, prefills then decodes) of
    the i-th all-gathered row (rank 0's tokens, then rank 1's, ...); ``inverse`` undoes it.
    ``wanted``: of the rows whose logits the step needs (in step order), the indices this rank holds."""

    group: ProcessGroup | None  # the cp group
    rank: int
    counts: list[int]  # the step tokens each cp rank holds
    order: Tensor  # [step tokens] long
    inverse: Tensor  # [step tokens] long
    wanted: Tensor  # [this rank's wanted rows] long: their places among all wanted rows
    num_wanted: int
    prefill: str = "pass-q"  # how fresh prefills are attended: "pass-q", "ulysses" or "ring" (module docstring)
    _layouts: dict = field(default_factory=dict, repr=False)  # the fresh prompts' layouts of this step

    @classmethod
    def build(
        cls, group, rank: int, owners: list[int], wanted_rows: list[int], device, prefill: str = "pass-q"
    ) -> ContextShards:
        """``owners``: the cp rank of each step row; ``wanted_rows``: step rows whose logits are needed."""
        cp = group_size(group)
        by_rank = [[i for i, o in enumerate(owners) if o == r] for r in range(cp)]
        order = torch.tensor([i for rows in by_rank for i in rows], dtype=torch.long, device=device)
        wanted = [j for j, row in enumerate(wanted_rows) if owners[row] == rank]
        return cls(
            group,
            rank,
            [len(rows) for rows in by_rank],
            order,
            torch.argsort(order),
            torch.tensor(wanted, dtype=torch.long, device=device),
            len(wanted_rows),
            prefill,
        )

    def gather_queries(self, q: Tensor) -> Tensor:
        """This rank's queries [own tokens, heads, d] -> every rank's, in step order [tokens, heads, d]."""
        return all_gather(q.contiguous(), self.group, dim=0, sizes=self.counts).index_select(0, self.inverse)

    def return_outputs(self, out: Tensor, lse: Tensor) -> Tensor:
        """Every step row's partial output [tokens, heads, d] (float32) and log-sum-exp [tokens,
        heads] over this rank's keys -> this rank's own rows' attention output [own, heads, d],
        merged over the cp ranks' keys."""
        h, d = out.shape[1:]
        mine = self.counts[self.rank]
        both = torch.cat([out, lse[..., None]], dim=-1).index_select(0, self.order)  # [tokens, h, d + 1], by owner
        got = all_to_all(both, self.group, send_sizes=self.counts, recv_sizes=[mine] * len(self.counts))
        parts = got.view(len(self.counts), mine, h, d + 1)
        return merge_partials(parts[..., :d], parts[..., d])

    def ulysses_prefill(
        self, q: Tensor, k: Tensor, v: Tensor, fresh: list[tuple[int, int]], heads, scale: float, window: int | None
    ) -> tuple[Tensor, Tensor]:
        """Attention of the step's fresh prefills, ``fresh`` = their (first step row, length) in step
        order, from this rank's q [own, q_heads, d], k, v [own, kv_heads, d]: (this rank's rows they
        cover, as indices into its own tokens [m]; their outputs [m, kv * group, d] in ``heads``'
        grouped layout)."""
        cp, d = len(self.counts), q.shape[-1]
        mine, sent, step = self._fresh_layout(tuple(fresh))
        m = len(mine)
        x = ulysses_units(q[mine], k[mine], v[mine], heads, cp)  # [m, units, per + 2, d]
        units, per = x.shape[1], x.shape[2] - 2
        mine_u = units // cp
        x = x.view(m, cp, mine_u, per + 2, d).transpose(0, 1).reshape(cp * m, mine_u, per + 2, d)
        x = all_to_all(x, self.group, send_sizes=[m] * cp, recv_sizes=sent)  # [fresh, mine_u, per + 2, d], owner order
        x = x.index_select(0, step)  # step order: each prompt's tokens together, in position order
        out = torch.empty((x.shape[0], mine_u, per, d), dtype=q.dtype, device=q.device)
        at = 0
        for _, length in fresh:  # each prompt alone
            o = causal_attention(x[at : at + length].permute(1, 2, 0, 3), scale, window)  # [mine_u * per, L, d]
            out[at : at + length] = o.view(mine_u, per, length, d).permute(2, 0, 1, 3)
            at += length
        out = out.index_select(0, torch.argsort(step))  # back to owner order
        out = all_to_all(out, self.group, send_sizes=sent, recv_sizes=[m] * cp)  # [cp * m, mine_u, per, d]
        return mine, out.view(cp, m, mine_u, per, d).transpose(0, 1).reshape(m, units * per, d)

    def ring_prefill(
        self, q: Tensor, k: Tensor, v: Tensor, fresh: list[tuple[int, int]], heads, scale: float, window: int | None
    ) -> tuple[Tensor, Tensor]:
        """Ring attention of the step's fresh prefills (``fresh`` as for ``ulysses_prefill``): this
        rank's queries stay, the fresh tokens' k, v go around the ring. Returns (this rank's rows
        they cover [m]; their outputs [m, kv * group, d], float32, in ``heads``' grouped layout)."""
        mine, sent, _ = self._fresh_layout(tuple(fresh))
        spans = self._ring_layout(tuple(fresh))
        m, d, kv = len(mine), q.shape[-1], heads.num_kv
        qs = heads.group_q(q[mine]).view(m, kv, heads.per_kv, d).permute(1, 2, 0, 3)  # [kv, group, m, d]
        out = torch.zeros(qs.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qs.shape[:-1], float("-inf"), device=q.device)  # [kv, group, m]
        blocks = [(2, n, kv, d) for n in sent]  # rank r's block: its fresh tokens' k and v
        for src, kv_block in ring_blocks(torch.stack([k[mine], v[mine]]), self.group, blocks):
            for (rows, q_pos), (cols, k_pos) in zip(spans[self.rank], spans[src]):  # prompt by prompt
                if rows.start == rows.stop or cols.start == cols.stop:
                    continue
                ks, vs = kv_block[0, cols].transpose(0, 1), kv_block[1, cols].transpose(0, 1)  # [kv, keys, d]
                o, o_lse = partial_attention(qs[:, :, rows], ks, vs, q_pos, k_pos, scale, window)
                # a query's own key is in the first block (its own rank's), so lse is finite from then on
                out[:, :, rows] = merge_partials(
                    torch.stack([out[:, :, rows], o]), torch.stack([lse[..., rows], o_lse])
                )
                lse[..., rows] = torch.logaddexp(lse[..., rows], o_lse)
        return mine, out.permute(2, 0, 1, 3).reshape(m, kv * heads.per_kv, d)

    def _fresh_layout(self, fresh: tuple[tuple[int, int], ...]) -> tuple[Tensor, list[int], Tensor]:
        """Where the fresh prompts' tokens are, once per step (every layer asks): this rank's
        own ones [m] (indices into its tokens), how many each rank holds, and the permutation from
        their all-to-all order (rank by rank) to step order."""
        if ("fresh", fresh) not in self._layouts:
            is_fresh = torch.zeros(len(self.order), dtype=torch.bool, device=self.order.device)
            for start, length in fresh:
                is_fresh[start : start + length] = True
            by_owner = is_fresh[self.order]  # [step tokens], owner order
            firsts = [sum(self.counts[:s]) for s in range(len(self.counts))]
            sent = [int(by_owner[a : a + n].sum()) for a, n in zip(firsts, self.counts)]
            a, n = firsts[self.rank], self.counts[self.rank]
            mine = torch.nonzero(by_owner[a : a + n]).flatten()
            self._layouts["fresh", fresh] = (mine, sent, torch.argsort(self.order[by_owner]))
        return self._layouts["fresh", fresh]

    def _ring_layout(self, fresh: tuple[tuple[int, int], ...]) -> list[list[tuple[slice, Tensor]]]:
        """[cp rank][fresh prompt]: (the prompt's rows in that rank's fresh tokens, their positions
        in the prompt [rows], ascending), once per step. A rank's tokens are in step order, so a
        prompt's are one run of them."""
        if ("ring", fresh) not in self._layouts:
            ends = torch.tensor([[start, start + length] for start, length in fresh], device=self.order.device)
            spans = []
            for a, n in zip(itertools.accumulate([0, *self.counts]), self.counts):
                rows = self.order[a : a + n]  # this rank's step rows, ascending
                rows = rows[((rows[:, None] >= ends[:, 0]) & (rows[:, None] < ends[:, 1])).any(1)]  # fresh ones
                cuts = torch.searchsorted(rows, ends).tolist()  # [prompts, 2]: each prompt's run
                spans.append([(slice(lo, hi), rows[lo:hi] - start) for (start, _), (lo, hi) in zip(fresh, cuts)])
            self._layouts["ring", fresh] = spans
        return self._layouts["ring", fresh]

    def gather_rows(self, h: Tensor) -> Tensor:
        """This rank's wanted rows [own wanted, dim] -> all of them in step order [wanted, dim], on
        every cp rank (each row is non-zero on its owner only, so the sum is exact)."""
        full = h.new_zeros(self.num_wanted, h.shape[-1])
        full[self.wanted] = h
        return all_reduce(full, self.group)


def merge_partials(out: Tensor, lse: Tensor) -> Tensor:
    """Attention over the union of disjoint key sets from each part's output [parts, ..., d] and
    log-sum-exp [parts, ...] (-inf: the part had no visible key): softmax weights exp(lse - max)."""
    top = lse.amax(0)
    top = top.masked_fill(top == float("-inf"), 0.0)
    w = torch.exp(lse - top)  # [parts, ...]
    return (w[..., None] * out).sum(0) / w.sum(0)[..., None]


def partial_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float, window: int | None, tile: int = 256
) -> tuple[Tensor, Tensor]:
    """Causal attention of queries q [kv, group, n, d] at ``q_pos`` [n] to keys and values k, v
    [kv, m, d] at ``k_pos`` [m] (ascending): (output [kv, group, n, d], log-sum-exp [kv, group, n]),
    float32; a query with no visible key gets output 0 and log-sum-exp -inf. Queries go ``tile``
    at a time, each tile against only the keys some of its queries see (the causal upper triangle
    and what lies before a window are skipped), so the scores stay [tile, m] per head at most."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    for a in range(0, q.shape[2], tile):
        qp = q_pos[a : a + tile, None]
        hi = int(torch.searchsorted(k_pos, qp.max(), right=True))  # keys after the last query: hidden
        lo = 0 if window is None else int(torch.searchsorted(k_pos, qp.min() - window, right=True))
        if lo >= hi:
            continue
        kp = k_pos[lo:hi]
        mask = kp[None, :] <= qp  # [t, keys]
        if window is not None:
            mask &= kp[None, :] > qp - window
        s = masked_scores(q[None, :, :, a : a + tile], k[None, :, lo:hi], scale, mask)[0]  # [kv, g, t, keys]
        m = s.amax(-1, keepdim=True)
        m = m.masked_fill(m == float("-inf"), 0.0)
        p = torch.exp(s - m)
        total = p.sum(-1, keepdim=True)  # [kv, g, t, 1]
        out[:, :, a : a + tile] = (p @ v[:, None, lo:hi].float()) / total.clamp_min(1e-38)
        lse[:, :, a : a + tile] = (m + torch.log(total)).squeeze(-1)  # log 0 = -inf: nothing visible
    return out, lse

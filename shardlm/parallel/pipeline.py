"""Pipeline parallelism: which layers each stage holds, and the links between stages.

A stage holds a contiguous run of decoder layers; the first stage also holds the token
embedding and the last the final norm and LM head (GPipe, Huang et al. 2019,
https://arxiv.org/abs/1811.06965). Stages are balanced by the work of one token: a
layer's multiply-adds, which are also the weight bytes it reads per decode step. The LM
head counts in full on the last stage (for SmolLM2 it is worth ~8 layers); the embedding
costs the first stage nothing, since a lookup reads one row per token, though it holds the
matrix. For SmolLM2 at pp=2 this gives 19 + 11 layers; a parameter-balanced 15 + 15 leaves the
first stage waiting behind the LM-head stage (benchmarks/pipeline.py; docs/performance.md,
"Pipeline").

The bubble: with p stages and m micro-batches in flight, a single pass leaves each
stage idle for a fraction (p - 1) / (m + p - 1) of the time (the fill and drain of the
pipeline). The engine therefore keeps m >= p micro-batches in flight; in steady-state
decode a micro-batch's next step starts as soon as its tokens come back, so stages
stay busy between the fill and the drain.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardlm.parallel import comm
from shardlm.parallel.dims import LayoutError, ParallelDims


def partition_layers(
    layer_costs: list[float], stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0
) -> list[range]:
    """Split layers into ``stages`` contiguous non-empty runs minimising the costliest stage.

    ``first_extra``/``last_extra`` are the embedding's and LM head's costs, charged to the
    first and last stage. Exact dynamic programme, O(L^2 p).
    """
    n = len(layer_costs)
    if not 1 <= stages <= n:
        raise LayoutError(f"pp={stages} needs at least one layer per stage but the model has {n} layers; use pp <= {n}")
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int, s: int) -> float:  # stage s holds layers [i, j)
        return prefix[j] - prefix[i] + (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: least max-cost of stages 0..s holding layers [0, j); cut[s][j]: where stage s starts
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(i, j, s))
                if c < best[s][j]:
                    best[s][j], cut[s][j] = c, i
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def stage_layers(cfg, pp: int, override: tuple[int, ...] | None = None) -> list[range]:
    """Layers of every stage for a model config: balanced by per-token work, or the user's ``--pp-layers``."""
    if override is not None:
        if len(override) != pp or any(n < 1 for n in override) or sum(override) != cfg.num_layers:
            raise LayoutError(
                f"--pp-layers {','.join(map(str, override))} must give {pp} positive counts summing to "
                f"the model's {cfg.num_layers} layers, e.g. "
                f"{','.join(str(len(r)) for r in stage_layers(cfg, pp))}"
            )
        starts = [sum(override[:s]) for s in range(pp)]
        return [range(a, a + n) for a, n in zip(starts, override)]
    head = cfg.vocab_size * cfg.hidden_size  # the LM head's multiply-adds per token; the lookup is ~free
    return partition_layers([layer_params(cfg)] * cfg.num_layers, pp, last_extra=head)


def layer_params(cfg) -> float:
    """Parameters of one dense decoder layer (attention + SwiGLU MLP + two norms)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * h * (cfg.moe_intermediate_size * max(cfg.num_experts, 1) if cfg.is_moe else cfg.intermediate_size)
    return float(attn + mlp + 2 * h)


class StageLinks:
    """Point-to-point links of this rank's stage, on its pp group (peers share its tp rank).

    Hidden states flow stage s -> s+1; sampled tokens flow from the last stage to the
    first and are then forwarded s -> s+1 (up to the stage before the last), so every
    stage learns each step's tokens. Sends are asynchronous; receives block.
    """

    def __init__(self, dims: ParallelDims):
        self.group = dims.pp_group
        self.stage, self.stages = dims.pp_rank, dims.pp
        self.pending: list[dist.Work] = []

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def _send(self, x: torch.Tensor, dst: int) -> None:
        self.pending = [w for w in self.pending if not w.is_completed()]
        self.pending.append(comm.isend(x, dst, self.group))  # the handle keeps x alive until sent

    def send_hidden(self, hidden: torch.Tensor) -> None:
        self._send(hidden.contiguous(), self.stage + 1)

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        return comm.recv(shape, dtype, self.stage - 1, self.group, device=device)

    def send_tokens(self, values: list[float], device) -> None:
        """Last stage: send a step's sampled tokens (and their logprobs) to the first stage, as
        float64: token ids are exact in it up to 2**53."""
        if self.stages > 1:
            self._send(torch.tensor(values, dtype=torch.float64, device=device), 0)

    def recv_tokens(self, count: int, device) -> list[float]:
        """Any other stage: a step's ``count`` values from ``send_tokens``, passed on down the pipeline."""
        src = self.stages - 1 if self.first else self.stage - 1
        got = comm.recv((count,), torch.float64, src, self.group, device=device)
        if self.stage + 1 < self.stages - 1:  # stages 0..p-2 need them; the last sampled them
            self._send(got, self.stage + 1)
        return got.tolist()

    def flush(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending = []

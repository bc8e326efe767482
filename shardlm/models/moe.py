"""Sparse mixture-of-experts blocks: Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeekMoE.

y = sum over the top-k experts e of w_e * SwiGLU_e(x) (Shazeer et al. 2017,
https://arxiv.org/abs/1701.06538; Mixtral, Jiang et al. 2024, https://arxiv.org/abs/2401.04088),
with the router's probabilities p = softmax(x W_r^T) in float32 and w = the top-k of p,
renormalised to sum to one for Mixtral (= softmax over the top-k logits) and when
``norm_topk_prob`` is set (Qwen3-MoE), left as they are otherwise (Qwen1.5/Qwen2-MoE).
Qwen2-MoE adds a shared expert every token goes through, scaled by sigmoid(x w_g).

DeepSeekMoE (DeepSeek-V2 §2.2, https://arxiv.org/abs/2405.04434; DeepSeek-V3 §2.1.2,
https://arxiv.org/abs/2412.19437): shared experts (one ungated SwiGLU of n_shared x the expert
width) beside the routed ones; group-limited routing (the top-k among the experts of the
``topk_group`` best of ``n_group`` groups); V2 scores by softmax and a group by its best expert,
V3 by sigmoid and a group by its two best, choosing with a learned correction bias added
(auxiliary-loss-free balancing) while weighting by the unbiased scores; both scale the routed
weights by ``routed_scaling_factor``. The router runs in float32 (HF keeps DeepSeek's gate in it).

No collectives here: the routed experts are an ``ExpertParallelSwiGLU`` (parallel/expert.py),
which decides which rank computes what; the shared expert is a tensor-parallel SwiGLU.
The router is replicated: it runs wherever the tokens are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardlm.models.config import DEEPSEEK, ModelConfig
from shardlm.parallel.comm import all_reduce
from shardlm.parallel.dims import LayoutError, ParallelDims
from shardlm.parallel.eplb import ExpertPlacement
from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.parallel.tensor import ColumnParallelLinear, RowParallelLinear, TensorSource, linear, shard_range


def block_prefix(cfg: ModelConfig, layer_prefix: str, src: TensorSource) -> str:
    """Where a layer's MoE tensors live: Mixtral checkpoints say ``block_sparse_moe``, the
    rest (and transformers 5's own in-memory names) ``mlp``."""
    legacy = f"{layer_prefix}.block_sparse_moe"
    return legacy if cfg.family == "mixtral" and src.has(f"{legacy}.gate.weight") else f"{layer_prefix}.mlp"


def expert_names(cfg: ModelConfig, layer_prefix: str):
    """names(src, e) -> the checkpoint names of logical expert e's gate, up and down weights, one
    2-D tensor each (Mixtral: experts.{e}.w1/w3/w2; the others: gate_proj/up_proj/down_proj), as
    transformers writes them and loads them back."""
    kinds = ("w1", "w3", "w2") if cfg.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")

    def names(src: TensorSource, e: int) -> tuple[str, str, str]:
        p = f"{block_prefix(cfg, layer_prefix, src)}.experts.{e}"
        gate, up, down = (f"{p}.{k}.weight" for k in kinds)
        return gate, up, down

    return names


def expert_reader(cfg: ModelConfig, layer_prefix: str):
    """read(src, e, rows) -> (gate rows, up rows, down columns) of logical expert e.

    Checkpoints keep one 2-D tensor per expert (Mixtral: experts.{e}.w1/w3/w2 = gate/up/down;
    Qwen: experts.{e}.gate_proj/up_proj/down_proj), which is what transformers writes too.
    A fused 3-D layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) is read
    one expert at a time (that expert's whole rows: with etp > 1 more than the rank keeps).
    """
    names, width = expert_names(cfg, layer_prefix), cfg.moe_intermediate_size

    def read(src: TensorSource, e: int, rows: slice):
        gate, up, down = names(src, e)
        if src.has(gate):
            return src.read(gate, rows=rows), src.read(up, rows=rows), src.read(down, cols=rows)
        p = f"{block_prefix(cfg, layer_prefix, src)}.experts"
        fused = src.read(f"{p}.gate_up_proj", rows=slice(e, e + 1))[0]  # [2I, H]
        fused_down = src.read(f"{p}.down_proj", rows=slice(e, e + 1))[0]  # [H, I]
        return fused[rows], fused[width + rows.start : width + rows.stop], fused_down[:, rows]

    return read


class Router(nn.Module):
    """Top-k routing with a replicated [experts, hidden] gate."""

    bias: torch.Tensor | None  # DeepSeek-V3's correction bias (a buffer), else None
    scores: torch.Tensor | None = None  # the last forward's scores (SparseMoE takes them)

    def __init__(self, cfg: ModelConfig, layer_prefix: str, dtype: torch.dtype):
        super().__init__()
        self.cfg, self.layer_prefix, self.k = cfg, layer_prefix, cfg.num_experts_per_tok
        self.normalise = cfg.norm_topk_prob or cfg.family == "mixtral"  # HF's Mixtral always renormalises
        self.deepseek = cfg.family in DEEPSEEK
        gate_dtype = torch.float32 if self.deepseek else dtype
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=gate_dtype), requires_grad=False)
        # DeepSeek-V3's correction bias: it steers the choice only, never the weights (not trained
        # by gradients: a buffer, as in HF)
        bias = torch.zeros(cfg.num_experts, dtype=torch.float32) if cfg.family == "deepseek_v3" else None
        self.register_buffer("bias", bias, persistent=False)
        self.source = f"{layer_prefix}.mlp.gate"  # block_prefix settles it at load

    def whole_tensors(self) -> list[tuple[str, nn.Parameter]]:
        return [(f"{self.source}.weight", self.weight)]

    def load(self, src: TensorSource) -> None:
        self.source = prefix = f"{block_prefix(self.cfg, self.layer_prefix, src)}.gate"
        with torch.no_grad():
            self.weight.copy_(src.read(f"{prefix}.weight"))
            if self.bias is not None and src.has(f"{prefix}.e_score_correction_bias"):
                self.bias.copy_(src.read(f"{prefix}.e_score_correction_bias"))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], expert ids [tokens, k]); ``scores`` keeps the router's scores
        [tokens, experts] (float32) for the load-balancing loss."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight) if self.deepseek else linear(x, self.weight).float()
        scores = logits.sigmoid() if cfg.scoring_func == "sigmoid" else F.softmax(logits, dim=-1)  # [tokens, experts]
        self.scores = scores
        if cfg.topk_method == "group_limited":
            ids = self._group_limited(scores if self.bias is None else scores + self.bias)
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(scores, self.k, dim=-1)  # highest probability first
        if self.normalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.routed_scaling_factor != 1.0:
            weights = weights * cfg.routed_scaling_factor
        # HF's Mixtral and DeepSeek scale by float32 weights, Qwen by weights in the model's dtype
        return (weights if cfg.family == "mixtral" or self.deepseek else weights.to(x.dtype)), ids

    def _group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """The top-k expert ids among the ``topk_group`` best groups of ``choice`` [tokens, experts]."""
        g = self.cfg.n_group
        grouped = choice.view(choice.shape[0], g, choice.shape[1] // g)  # [tokens, groups, experts per group]
        if self.cfg.family == "deepseek_v3":  # a group scores the sum of its two best experts
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = torch.topk(group_scores, self.cfg.topk_group, dim=-1).indices  # [tokens, topk_group]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        masked = grouped.masked_fill(~allowed[..., None], float("-inf")).view_as(choice)
        return torch.topk(masked, self.k, dim=-1).indices


class SharedExpert(nn.Module):
    """Qwen2-MoE: sigmoid(x w_g) * SwiGLU(x); DeepSeek: SwiGLU(x) (its shared experts fused into
    one); the SwiGLU split over tp like a dense MLP."""

    def __init__(self, cfg: ModelConfig, dims: ParallelDims, prefix: str, dtype: torch.dtype):
        super().__init__()
        self.prefix = prefix
        rows = shard_range(cfg.shared_expert_intermediate_size, dims.tp, dims.tp_rank)
        gated = cfg.family not in DEEPSEEK
        p = f"{prefix}.shared_expert" if gated else f"{prefix}.shared_experts"
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size,
            [(f"{p}.gate_proj", rows), (f"{p}.up_proj", rows)],
            bias=False,
            group=dims.tp_group,
            dtype=dtype,
        )
        self.down = RowParallelLinear(
            f"{p}.down_proj", rows, cfg.hidden_size, bias=False, group=dims.tp_group, dtype=dtype
        )
        self.gate_weight = (
            nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype), requires_grad=False) if gated else None
        )

    def whole_tensors(self) -> list[tuple[str, nn.Parameter]]:
        return [] if self.gate_weight is None else [(f"{self.prefix}.shared_expert_gate.weight", self.gate_weight)]

    def load(self, src: TensorSource) -> None:  # the gate only; gate_up and down load themselves
        if self.gate_weight is not None:
            with torch.no_grad():
                self.gate_weight.copy_(src.read(f"{self.prefix}.shared_expert_gate.weight"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [tokens, local shared width] each
        y = self.down(F.silu(gate) * up)
        return y if self.gate_weight is None else torch.sigmoid(linear(x, self.gate_weight)) * y


class SparseMoE(nn.Module):
    """The MLP of an MoE decoder layer: routed experts (+ Qwen2-MoE's shared expert)."""

    keep_stats = False
    """Training with a load-balancing loss: each forward appends (router probabilities summed over
    its tokens [experts], differentiable; top-k choices per expert [experts]; tokens) to ``stats``."""

    def __init__(
        self,
        cfg: ModelConfig,
        dims: ParallelDims,
        layer_prefix: str,
        dtype: torch.dtype,
        placement: ExpertPlacement | None = None,
        dispatch: str = "auto",
    ):
        super().__init__()
        self.router = Router(cfg, layer_prefix, dtype)
        self.experts = ExpertParallelSwiGLU(
            num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.moe_intermediate_size,
            read=expert_reader(cfg, layer_prefix),
            names=expert_names(cfg, layer_prefix),
            dims=dims,
            dtype=dtype,
            placement=placement,
            dispatch=dispatch,
        )
        self.shared = (
            SharedExpert(cfg, dims, f"{layer_prefix}.mlp", dtype) if cfg.shared_expert_intermediate_size else None
        )
        self.stats: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)  # [tokens, k] each
        if self.keep_stats:
            counts = torch.bincount(ids.flatten(), minlength=self.router.weight.shape[0]).float()
            assert self.router.scores is not None  # the router's forward just set them
            self.stats.append((self.router.scores.sum(0), counts, x.shape[0]))
        self.router.scores = None
        y = self.experts(x, ids, weights)  # [tokens, hidden]
        return y if self.shared is None else y + self.shared(x)


def load_balancing_loss(blocks: list[SparseMoE], group) -> torch.Tensor:
    """This rank's share of the load-balancing loss over every block's statistics since the last
    call (then cleared): E * sum_e f_e * P_e, with f_e the fraction of all top-k choices that went
    to expert e and P_e its mean router probability, both over every token and layer of the ranks
    of ``group`` (dp x cp; HF's load_balancing_loss_func concatenates the layers the same way). f
    and the token count are summed over ``group`` first; P's sum stays this rank's, so the shares
    of the group's ranks add up to the loss and each rank's gradient is its tokens' part."""
    stats = [s for b in blocks for s in b.stats]
    for b in blocks:
        b.stats = []
    probs = torch.stack([p for p, _, _ in stats]).sum(0)  # [experts], differentiable
    counts = torch.stack([c for _, c, _ in stats]).sum(0)  # [experts]: top-k choices
    rows = torch.tensor([float(sum(n for _, _, n in stats))], device=counts.device)
    counts, rows = all_reduce(counts, group), all_reduce(rows, group)
    return (counts / rows * (probs / rows)).sum() * probs.shape[0]


@torch.no_grad()
def update_expert_bias(blocks: list[SparseMoE], rate: float, group) -> None:
    """DeepSeek-V3's bias update (§2.1.2 of https://arxiv.org/abs/2412.19437): each layer's correction
    bias += rate * sign(mean load - load), the load being each expert's top-k choices since the
    last update, summed over ``group`` (dp x cp), so every rank moves it alike."""
    for b in blocks:
        if b.router.bias is None or not b.stats:
            continue
        load = all_reduce(torch.stack([c for _, c, _ in b.stats]).sum(0), group)
        b.router.bias += rate * torch.sign(load.mean() - load)


def check_expert_layout(cfg: ModelConfig, ep: int, etp: int) -> None:
    """Reject ep/etp the model cannot take (before any rank starts)."""
    if not cfg.is_moe:
        if ep > 1 or etp > 1:
            raise LayoutError(f"ep={ep}, etp={etp}: {cfg.family} is a dense model without experts; use ep=1 etp=1")
        return
    ExpertPlacement.contiguous(cfg.num_experts, ep)  # ep <= experts, naming the valid ones
    if etp > cfg.moe_intermediate_size:
        raise LayoutError(
            f"etp={etp} is larger than the expert width {cfg.moe_intermediate_size}; "
            f"use etp <= {cfg.moe_intermediate_size}"
        )


def needs_lockstep(model: nn.Module) -> bool:
    """Whether dp replicas share expert collectives (all-to-all over ranks of several replicas),
    so that every replica must run a forward (a real one, or ``idle_forward``) whenever any does."""
    return any(b.experts.dispatch == "all_to_all" for b in moe_blocks(model))


def moe_blocks(model: nn.Module) -> list[SparseMoE]:
    """The model's MoE blocks, in layer order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@torch.inference_mode()
def idle_forward(model: nn.Module) -> None:
    """DP attention: what a dp replica with no sequences runs for each step the others run.

    Every MoE block gets an empty batch, so this rank still joins the block's expert
    collectives (with zero counts) in layer order, exactly as a real step would.
    Attention, dense layers and the LM head talk only inside the replica, so they are skipped.
    """
    for block in moe_blocks(model):
        w = block.router.weight
        block(w.new_zeros((0, w.shape[1]), dtype=block.experts.dtype))

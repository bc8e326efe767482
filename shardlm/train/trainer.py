"""One rank of a training run: its shard of the model (tp), its share of each batch (dp), ZeRO.

A step takes a global batch of token windows [batch, seq_len + 1]; dp rank r trains on rows
[r * batch/dp, (r + 1) * batch/dp), in ``grad_accum`` micro-batches. The loss is the mean
next-token cross-entropy over the whole global batch (the vocab-parallel loss, divided by the
global number of target tokens), so any layout takes the same step as one process does.
"""

from __future__ import annotations

import itertools
import json
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from shardlm.errors import ClosedError, UsageError
from shardlm.launch import holds_group, start_rank, torchrun_env
from shardlm.models.attention import causal_metadata
from shardlm.models.config import DEEPSEEK
from shardlm.models.loader import load_model, open_checkpoint
from shardlm.models.moe import load_balancing_loss, moe_blocks, update_expert_bias
from shardlm.models.transformer import MLP
from shardlm.parallel.comm import all_reduce
from shardlm.parallel.context import ALGORITHMS, ContextBatch, check_ulysses, zigzag_positions
from shardlm.parallel.dims import LayoutError, ParallelDims
from shardlm.parallel.pipeline import stage_layers
from shardlm.parallel.schedules import check_schedule, stage_orders, virtual_stage_layers
from shardlm.parallel.tensor import RowParallelLinear, partition_heads, whole_tensors
from shardlm.train import state
from shardlm.train.checkpoint import save
from shardlm.train.loss import IGNORE_INDEX, vocab_parallel_cross_entropy
from shardlm.train.lr import SCHEDULES, lr_factor
from shardlm.train.schedule import StageIO
from shardlm.train.zero import STAGES, Zero

RECOMPUTE = ("none", "selective", "full")
AXES = ("dp", "pp", "cp", "tp", "ep", "etp")
"""The parallel axes training runs (ep and etp fold over dp x tp in MoE layers)."""


@dataclass(kw_only=True)
class TrainConfig:
    model: str = "smollm2"
    """'smollm2' (embedded), a HF directory or a .gguf file, as for generate."""
    parallel: ParallelDims = field(default_factory=ParallelDims)
    """The layout over ranks (``AXES``): dp ranks each train on their share of every batch; pp stages
    each hold a run of layers (``vpp`` runs under the interleaved schedule), a step's micro-batches
    (``grad_accum``) flowing through them in ``pp_schedule``; cp ranks each hold 2 of 2 x cp chunks of every sequence (seq_len must split); tp
    ranks each hold a slice of every weight matrix."""
    pp_schedule: str = "1f1b"
    """The pipeline schedule (parallel/schedules.py): "1f1b" (PipeDream-Flush), "gpipe" (all
    forwards, then all backwards), "interleaved" (1F1B over ``vpp`` chunks of layers per stage;
    grad_accum a multiple of pp) or "zb-h1" (zero-bubble: weight gradients deferred into the
    bubbles)."""
    vpp: int = 1
    """Chunks of layers per pipeline stage (the interleaved schedule's virtual stages; the layers
    must split into pp x vpp equal chunks)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: between the tp regions each tp rank holds 1/tp of the tokens
    (norms and residual adds on a share; all-gather / reduce-scatter instead of all-reduce). A
    micro-batch's tokens on a rank (sequences x seq_len / cp) must split evenly over tp."""
    cp_attention: str = "all-gather"
    """How attention sees the whole sequence under cp: "all-gather" (each layer gathers all keys and
    values), "ring" (ring attention: key/value blocks passed rank to rank, overlapped with
    compute; a rank holds two blocks, not the whole sequence's) or "ulysses" (all-to-alls put
    each rank's share of the heads over the whole sequence; cp must split the KV heads)."""
    zero: int = 1
    """ZeRO stage over the dp ranks: 0 plain data parallel, 1 optimizer state sharded, 2 also
    gradients, 3 also weights."""
    prefetch: int | None = None
    """ZeRO-3: decoder layers whose weights are all-gathered ahead, in flight while a layer
    computes (forward, and the re-gathers of backward); 0 gathers each when it is needed; None:
    1 on a GPU, 0 on CPU ranks (their blocking shared-memory collectives beat gloo's
    asynchronous ones: docs/performance.md)."""
    bucket_mb: float | None = None
    """ZeRO 0-2: gradients are reduced in buckets of about this many MiB (float32, whole decoder
    layers), each started asynchronously as soon as backward has completed it (DDP's
    bucket_cap_mb); 0 reduces without overlap (stages 0-1 after backward, 2 a layer at a time);
    None: 25 on a GPU, 0 on CPU ranks (as ``prefetch``)."""
    dtype: str = "auto"
    """Weights, activations and gradients: float32, or bfloat16 / float16 with float32 master
    weights in the optimizer (mixed precision; gradients are summed over ranks in float32);
    float16 with dynamic loss scaling. "auto": bfloat16 on a GPU, float32 on CPU ranks."""
    device: str = "auto"
    """"cuda": rank r on its host's GPU ``local_rank`` (NCCL for GPU tensors, gloo for the rest);
    "cpu"; "auto": cuda when this host has a GPU per rank, else cpu."""
    loss_scale: float = 2.0**16
    """float16: the initial loss scale; halved and the step skipped whenever a gradient overflows,
    doubled after 2000 steps in a row without (PyTorch GradScaler's defaults)."""
    lr: float = 1e-4
    """AdamW's peak learning rate (``lr_schedule`` shapes it over the steps)."""
    lr_schedule: str = "constant"
    """After ``warmup_steps``: "constant", or a "linear" / "cosine" decay to ``lr_min`` x lr at the
    last of ``total_steps`` (lr.py)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from lr / (warmup_steps + 1) up to lr."""
    lr_min: float = 0.0
    """The decay's end, as a fraction of lr (a decaying schedule only)."""
    total_steps: int | None = None
    """Steps of the whole run (what a decaying schedule decays over; resumed runs count the saved ones)."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.0
    recompute: str = "none"
    """Activation recomputation: "none"; "selective": the SwiGLU activation (silu(gate) * up) is
    recomputed in backward, which halves the MLP's stored activations for a few elementwise ops
    (with fused attention there is no softmax to recompute, Korthikanti et al.'s selective
    target); "full": each decoder layer keeps only its inputs and runs its forward again there
    (activation checkpointing)."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None: no clipping)."""
    grad_accum: int = 1
    """Micro-batches per step on each dp rank (gradient accumulation; with pp, at least pp keeps
    every stage busy)."""
    offload: str | None = None
    """"optimizer": ZeRO-Offload: on a GPU each rank's float32 masters and AdamW moments live in
    pinned CPU memory and the step runs there (torch's fused CPU AdamW), gradients copied down
    and weights up asynchronously; CPU ranks already hold them in CPU memory (nothing moves)."""
    aux_loss_coef: float = 0.0
    """MoE: weight of the load-balancing loss added to the loss (Switch Transformer's, Fedus et al.
    2021, https://arxiv.org/abs/2101.03961 eq. 4-6, over the step's whole batch and every layer at
    once, as HF transformers computes it with output_router_logits: num_experts x sum over experts
    of the fraction of top-k choices x the mean router probability); 0: none, as HF by default. Its
    statistics are summed over the dp and cp ranks; it needs pp=1 and grad_accum=1 (a step's whole
    batch in one forward)."""
    bias_update_rate: float = 0.0
    """DeepSeek-V3's auxiliary-loss-free balancing (https://arxiv.org/abs/2412.19437 §2.1.2): after
    each step every MoE layer's correction bias (which steers the choice of experts, not their
    weights) moves by this much for each expert, up if the step's tokens chose it less often than
    the mean expert, down if more often (counted over the dp and cp ranks); 0: fixed, as in HF.
    V3 trained with 0.001."""
    compile: bool = False
    """Run each decoder layer's forward and backward through torch.compile (inductor: fused
    kernels; a one-time compile of two graphs, the first layer's and the others')."""
    threads: int | None = None
    """CPU threads per rank (default: this host's cores shared among its ranks)."""
    timeout_s: float = 300.0
    """Collective timeout: a dead or stuck rank ends the run after this long."""

    def __post_init__(self) -> None:
        check_schedule(self.pp_schedule, self.parallel.pp, self.grad_accum, self.vpp)
        if self.zero not in STAGES:
            raise UsageError(
                f"zero={self.zero!r} is not a ZeRO stage; use one of {STAGES} (0: plain data "
                f"parallel, 1: optimizer state sharded, 2: + gradients, 3: + weights)"
            )
        if self.lr <= 0:
            raise UsageError(f"lr={self.lr!r} must be positive, e.g. 1e-4")
        if self.grad_accum < 1:
            raise UsageError(f"grad_accum={self.grad_accum!r} must be a positive integer")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UsageError(
                f"dtype={self.dtype!r} is not supported for training; use auto, float32, bfloat16 or float16"
            )
        if self.offload not in (None, "optimizer"):
            raise UsageError(
                f"offload={self.offload!r}: only the optimizer offloads (its masters and AdamW moments); "
                f"use offload='optimizer' or None"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"device={self.device!r} is not a device; use auto, cpu or cuda")
        if self.prefetch is not None and (not isinstance(self.prefetch, int) or self.prefetch < 0):
            raise UsageError(f"prefetch={self.prefetch!r} must be a whole number of layers >= 0, e.g. 1 (0: off)")
        if self.bucket_mb is not None and not self.bucket_mb >= 0:
            raise UsageError(f"bucket_mb={self.bucket_mb!r} must be >= 0 MiB, e.g. 25 (0: no overlap)")
        if not self.loss_scale > 0:
            raise UsageError(f"loss_scale={self.loss_scale!r} must be positive, e.g. 65536")
        if self.cp_attention not in ALGORITHMS:
            raise UsageError(f"cp_attention={self.cp_attention!r} is not supported; use one of {ALGORITHMS}")
        if self.cp_attention != "all-gather" and self.parallel.cp == 1:
            raise UsageError(
                f"cp_attention={self.cp_attention!r} spreads attention over cp ranks, and cp=1; raise cp "
                "(--cp 2) or drop cp_attention"
            )
        if self.recompute not in RECOMPUTE:
            raise UsageError(f"recompute={self.recompute!r} is not supported; use one of {RECOMPUTE}")
        if self.lr_schedule not in SCHEDULES:
            raise UsageError(f"lr_schedule={self.lr_schedule!r} is not a schedule; use one of {SCHEDULES}")
        if not _count(self.warmup_steps):
            raise UsageError(f"warmup_steps={self.warmup_steps!r} must be a non-negative integer, e.g. 100")
        if self.lr_schedule != "constant" and not (
            isinstance(self.total_steps, int) and self.total_steps > max(0, self.warmup_steps)
        ):
            raise UsageError(
                f"lr_schedule={self.lr_schedule!r} decays over the steps after the warm-up: total_steps="
                f"{self.total_steps!r} must be an integer above warmup_steps={self.warmup_steps}"
            )
        if not 0 <= self.lr_min < 1:
            raise UsageError(f"lr_min={self.lr_min!r} is a fraction of lr in [0, 1), e.g. 0.1")
        if self.lr_min and self.lr_schedule == "constant":
            raise UsageError(
                f"lr_min={self.lr_min} is where a decay ends, and lr_schedule='constant' does not decay; "
                f"use lr_schedule='cosine' or 'linear', or drop lr_min"
            )
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise UsageError(f"max_grad_norm={self.max_grad_norm!r} must be positive, or None for no clipping")
        if not isinstance(self.parallel, ParallelDims):
            raise UsageError(f"parallel={self.parallel!r} must be a ParallelDims, e.g. ParallelDims(dp=2)")
        self.parallel.refuse_beyond(AXES, "training")
        if not self.bias_update_rate >= 0:
            raise UsageError(f"bias_update_rate={self.bias_update_rate!r} must be >= 0, e.g. 0.001 (0: off)")
        if not self.aux_loss_coef >= 0:
            raise UsageError(
                f"aux_loss_coef={self.aux_loss_coef!r} must be >= 0, e.g. 0.01 (0: no load-balancing loss)"
            )
        if self.aux_loss_coef and (self.parallel.pp > 1 or self.grad_accum > 1):
            raise UsageError(
                f"aux_loss_coef={self.aux_loss_coef} balances the experts over the step's whole batch and every "
                f"layer at once (HF's formula), which pp={self.parallel.pp} stages and grad_accum="
                f"{self.grad_accum} micro-batches never hold together; use pp=1 and grad_accum=1, or aux_loss_coef=0"
            )

    @classmethod
    def of(cls, **options) -> TrainConfig:
        """From flat keywords (``TrainConfig.of(dp=2, zero=3)``): the axis sizes become ``parallel``."""
        return cls(parallel=ParallelDims.take(options), **options)

    def dims(self) -> ParallelDims:
        """The layout, without a mesh: each rank builds its own on a copy."""
        return self.parallel.unbuilt()


def train_dtype(dtype: str, device_type: str) -> str:
    """TrainConfig.dtype settled: "auto" is bfloat16 on a GPU (mixed precision, as torchtitan and
    Megatron train), float32 on CPU ranks (whose bfloat16 matmuls are slower)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device_type == "cuda" else "float32"


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_trainable(
    cfg,
    tp: int,
    *,
    cp: int = 1,
    cp_attention: str = "all-gather",
    dtype: str = "float32",
    aux_loss_coef: float = 0.0,
    bias_update_rate: float = 0.0,
    pp: int = 1,
    pp_schedule: str = "1f1b",
    vpp: int = 1,
) -> None:
    """Refuse what training does not support yet, with the reason."""
    check_schedule(pp_schedule, pp, None, vpp, layers=cfg.num_layers)
    if bias_update_rate and cfg.family != "deepseek_v3":
        raise UsageError(
            f"bias_update_rate={bias_update_rate}: {cfg.family} has no expert correction bias "
            f"(DeepSeek-V3's); use aux_loss_coef to balance its experts, or bias_update_rate=0"
        )
    if cfg.is_mla and cp > 1:
        raise LayoutError(
            f"cp={cp}: context parallelism does not run multi-head latent attention ({cfg.family}) yet; use cp=1"
        )
    if cfg.family in DEEPSEEK and dtype != "float32":
        raise UsageError(
            f"dtype={dtype!r}: {cfg.family}'s router stays in float32 (as in HF), and a ZeRO unit holds one "
            f"dtype; train it in float32"
        )
    if aux_loss_coef and cfg.family in DEEPSEEK:
        raise UsageError(
            f"aux_loss_coef={aux_loss_coef}: {cfg.family} balances its experts without an auxiliary loss "
            f"(HF trains it with none); use aux_loss_coef=0"
        )
    parts = [partition_heads(cfg.num_heads, cfg.num_kv_heads, tp, r) for r in range(tp)]
    if any(a.kv.stop > b.kv.start for a, b in itertools.pairwise(parts)):
        ok = [t for t in range(1, cfg.num_heads + 1) if cfg.num_kv_heads % t == 0]
        raise LayoutError(
            f"tp={tp} splits a KV head's query group over two ranks ({cfg.num_heads} query heads, "
            f"{cfg.num_kv_heads} KV heads): inference holds that KV head on both, training would "
            f"have to sum its gradients across them, which it does not; use tp in {ok}"
        )
    if cp_attention == "ulysses":
        check_ulysses(cfg.num_heads, cfg.num_kv_heads, tp, cp)


def replicated_over_tp(model: torch.nn.Module) -> set[int]:
    """Parameters every tp rank holds whole (their gradients are equal on every tp rank)."""
    out: set[int] = set()
    for m in model.modules():
        out.update(id(p) for _, p in whole_tensors(m))
        if isinstance(m, RowParallelLinear) and m.bias is not None:
            out.add(id(m.bias))
    return out


class Recomputed(torch.nn.Module):
    """A decoder layer that keeps only its input for backward and recomputes the rest there
    (activation checkpointing; Chen et al. 2016, https://arxiv.org/abs/1604.06174).

    A layer receives the previous one's output and the residual stream apart (its norm adds
    them first); their sum is the layer's input, so it is formed here, outside the checkpoint,
    and the layer runs as a first layer does (residual None). One tensor of s x b x h is kept
    instead of two (Korthikanti et al. 2022 §4: full recomputation stores the layer input), and
    the add is the one the norm would do, so the results are bitwise the same."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, h, residual, *rest):
        if residual is not None:
            h = h + residual  # [b, s, h]: the layer input; add saves nothing for backward
        return torch.utils.checkpoint.checkpoint(self.inner, h, None, *rest, use_reentrant=False)


class LossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al. 2018, "Mixed Precision
    Training", https://arxiv.org/abs/1710.03740 §3.2): the loss is multiplied by ``scale`` so small
    gradients stay above float16's smallest normal number; a step whose gradients overflow is
    skipped and the scale halved; after ``interval`` good steps in a row it doubles."""

    def __init__(self, scale: float, interval: int = 2000):
        self.scale, self.good, self.interval = scale, 0, interval

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good = self.scale / 2, 0
            return
        self.good += 1
        if self.good == self.interval:
            self.scale, self.good = self.scale * 2, 0


def _all_ranks_here() -> None:
    if dist.is_initialized():
        dist.barrier()


@dataclass
class _Pass:
    """A global batch laid out for one pass through this rank's stage (``Trainer._pass``)."""

    micros: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (inputs, targets, positions) each
    count: torch.Tensor  # target tokens of the whole global batch
    io: StageIO
    total: torch.Tensor  # the loss summed over this rank's tokens (last stage), filled by forward
    aux: torch.Tensor  # this rank's share of the load-balancing loss (summed over dp x cp: the whole)
    forward: Callable[[int, int], None]  # (micro-batch, chunk)


class Trainer:
    def __init__(self, config: TrainConfig, *, rank: int = 0, world: int = 1, init_method: str | None = None):
        env = torchrun_env()  # torchrun's local rank; ranks this process started share its host
        local_rank, local_world = (env["local_rank"], env["local_world"]) if env else (rank, world)
        self.device = start_rank(
            config.device, config.threads, rank=rank, world=world, local_rank=local_rank, local_world=local_world,
            init_method=init_method, timeout_s=config.timeout_s,
        )  # fmt: skip
        device_type = self.device.type
        dims = config.dims()
        dims.check_world_size(world)
        self.dims = dims = dims.build_mesh(device_type)
        self.config = config
        self.checkpoint = ckpt = open_checkpoint(config.model)
        self.dtype_name = train_dtype(config.dtype, device_type)
        check_trainable(
            ckpt.config,
            dims.tp,
            cp=dims.cp,
            cp_attention=config.cp_attention,
            dtype=self.dtype_name,
            aux_loss_coef=config.aux_loss_coef,
            pp=dims.pp,
            pp_schedule=config.pp_schedule,
            vpp=config.vpp,
        )
        layers = (
            virtual_stage_layers(ckpt.config.num_layers, dims.pp, config.vpp, dims.pp_rank)
            if config.vpp > 1
            else stage_layers(ckpt.config, dims.pp)[dims.pp_rank]
        )
        on_gpu = device_type == "cuda"  # overlap's defaults (TrainConfig.prefetch, bucket_mb)
        self.dtype = getattr(torch, self.dtype_name)
        self.model = model = load_model(
            ckpt,
            dims,
            dtype=self.dtype,
            device=self.device,
            layers=layers,
            sequence_parallel=config.sequence_parallel,
        )
        model.train().requires_grad_(True)
        self.vocab_start = model.lm_head.rows.start if model.last else 0
        # a tied embedding on the first and the last stage: one weight, two copies; their gradients are summed
        tied = model.embed.weight if dims.pp > 1 and ckpt.config.tie_word_embeddings and model.embed else None
        self.embedding_group = dims.embedding_group() if ckpt.config.tie_word_embeddings else None
        self.zero = Zero(
            model,
            dims.dp_cp_group,
            dims.tp,
            config.zero,
            replicated_over_tp(model),
            tied=tied,
            expert_group=dims.edp_cp_group,
            prefetch=(1 if on_gpu else 0) if config.prefetch is None else config.prefetch,
            bucket_mb=(25.0 if on_gpu else 0.0) if config.bucket_mb is None else config.bucket_mb,
            offload=config.offload == "optimizer",
        )
        if config.recompute == "selective":
            for module in model.modules():
                if isinstance(module, MLP):
                    module.recompute_act = True
        if config.recompute == "full":  # around ZeRO-3's gathering wrapper: the recomputation gathers again
            for i, layer in enumerate(model.layers):
                model.layers[i] = Recomputed(layer)
        if config.compile:  # the outermost wrapper: ZeRO-3's gathering and recomputation compile with the layer
            for layer in model.layers:
                layer.compile()
        offloaded = any(u.offloaded for u in self.zero.units)
        self.optimizer = torch.optim.AdamW(
            self.zero.shards(),
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
            fused=True if offloaded else None,  # the CPU step: torch's fused AdamW kernel
        )
        self.moe = moe_blocks(model)
        for block in self.moe:  # the load-balancing loss and the bias update read the router's statistics
            block.keep_stats = config.aux_loss_coef > 0 or config.bias_update_rate > 0
        self.timeline: list[tuple[str, int, int, float, float]] = []
        """The last step's pipeline operations on this rank: (kind, micro-batch, chunk, start, end)."""
        self.in_flight = 0
        """The most micro-batch chunks whose activations this rank held at once in the last step."""
        self.steps = 0  # steps taken (counting those of a loaded state, and float16's skipped ones)
        self.scaler = LossScaler(config.loss_scale) if self.dtype_name == "float16" else None
        holds_group(self)

    def close(self) -> None:
        """Let go of the model, its optimizer state and the mesh: the trainer cannot step after this.
        Called at exit under a group shardlm started, before it destroys the group (its subgroups
        end there, torch's registry holding them until then)."""
        vars(self).clear()
        self.closed = True

    if not TYPE_CHECKING:  # mypy keeps checking attribute names

        def __getattr__(self, name: str):  # only for a name not found: after close(), all of its state
            if self.__dict__.get("closed") and not name.startswith("__"):
                raise ClosedError("this Trainer is closed (close(), or the process's exit); build another")
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def spawned(cls, rank: int, world: int, init_method: str, config: TrainConfig) -> Trainer:
        return cls(config, rank=rank, world=world, init_method=init_method)

    def ready_info(self) -> dict:
        return {"params": sum(u.numel for u in self.zero.units), "coords": self.dims.coords(self.dims.global_rank)}

    def step(self, batch: torch.Tensor | list[list[int]]) -> dict:
        """One optimizer step on a global batch of token ids [batch, seq_len + 1] (every rank passes
        the same batch). Returns the batch's mean loss, the gradient norm before clipping, the
        learning rate it stepped with, seconds, the bytes of weights, gradients (at their peak,
        after backward) and optimizer state held, the process's peak resident memory so far, and
        both of those for the rank that holds the most (``heaviest_rank``)."""
        start = time.perf_counter()
        c = self.config
        lr = c.lr * lr_factor(
            self.steps, schedule=c.lr_schedule, warmup=c.warmup_steps, total=c.total_steps, floor=c.lr_min
        )
        scale = self.scaler.scale if self.scaler else 1.0
        run = self._pass(batch, scale)
        io, micros, count, total = run.io, run.micros, run.count, run.total
        run_backward = {"B": io.backward_input if c.pp_schedule == "zb-h1" else io.backward, "W": io.backward_weight}
        self.zero.start_backward()
        self.timeline = []
        for kind, i, chunk in stage_orders(c.pp_schedule, self.dims.pp, len(micros), c.vpp)[self.dims.pp_rank]:
            began = time.perf_counter()
            if kind == "F":
                run.forward(i, chunk)
            else:  # every schedule runs a chunk's backwards in micro-batch order: the last one reduces
                with self.zero.backward(last=i == len(micros) - 1, chunk=chunk):
                    run_backward[kind](i, chunk)
            self.timeline.append((kind, i, chunk, began, time.perf_counter()))
        self.in_flight = io.peak
        io.flush()
        held = self.zero.state_bytes()
        self.zero.finish_backward()
        if self.zero.tied is not None:
            assert self.zero.tied.master.grad is not None  # finish_backward reduced it (both stages call this)
            all_reduce(self.zero.tied.master.grad, self.embedding_group)
        if self.scaler:
            self.zero.scale_grads(1 / scale)
        norm = self.zero.grad_norm(self.dims.tp_group, self.dims.pp_group, count_tied=self.model.first)
        # the global norm is the same number on every rank: all skip an overflowing step together
        skipped = self.scaler is not None and not torch.isfinite(norm).item()
        if self.scaler:
            self.scaler.update(overflow=skipped)
        if skipped:
            self.zero.drop_grads()
        else:
            if self.config.max_grad_norm:
                self.zero.clip(self.config.max_grad_norm, norm)
            for param_group in self.optimizer.param_groups:
                param_group["lr"] = lr
            self.optimizer.step()
            self.zero.after_step()
            if self.config.bias_update_rate:
                update_expert_bias(self.moe, self.config.bias_update_rate, self.dims.dp_cp_group)
        for block in self.moe:
            block.stats = []
        self.steps += 1
        held["optimizer"] = held.pop("masters") + sum(  # moments (not the step count), 16-bit's masters
            t.nbytes for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
        )
        if any(u.offloaded for u in self.zero.units):  # in CPU memory, not the device's
            held["optimizer_offloaded"], held["optimizer"] = held["optimizer"], 0
        loss = all_reduce(all_reduce(total, self.dims.pp_group), self.dims.dp_cp_group) / count
        extra: dict = {} if self.scaler is None else {"loss_scale": scale, "skipped": skipped}
        if self.config.aux_loss_coef:  # the loss includes it, as HF's does; also reported alone
            aux = float(all_reduce(run.aux, self.dims.dp_cp_group))
            loss = loss + self.config.aux_loss_coef * aux
            extra["aux_loss"] = aux
        rss = (  # the process's peak: on a GPU its memory's, on CPU ranks resident memory (Linux: KiB)
            torch.cuda.max_memory_allocated(self.device)
            if self.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        )
        on_device = sum(v for k, v in held.items() if k != "optimizer_offloaded")
        heaviest = all_reduce(torch.tensor([float(on_device), float(rss)], dtype=torch.float64), None, "max")
        return {
            "loss": float(loss),
            "grad_norm": float(norm),
            "lr": lr,
            "tokens": int(count),
            **extra,
            "seconds": time.perf_counter() - start,
            "state_bytes": held,
            "max_rss_bytes": rss,
            "heaviest_rank": {"state_bytes": int(heaviest[0]), "peak_bytes": int(heaviest[1])},
        }

    def _pass(self, batch: torch.Tensor | list[list[int]], scale: float) -> _Pass:
        """Check a global batch and lay out this rank's share of it for one pass: micro-batch i's
        forward is ``forward(i, chunk)`` (on the last stage its loss, divided by the global target count
        and multiplied by ``scale``, is what backward starts from)."""
        batch = torch.as_tensor(batch)
        dp, r = self.dims.dp, self.dims.dp_rank  # cp ranks of one dp rank share its sequences
        if batch.dim() != 2 or batch.shape[1] < 2:
            raise UsageError(f"a batch is [sequences, seq_len + 1] token ids; got shape {tuple(batch.shape)}")
        if batch.shape[0] % (dp * self.config.grad_accum):
            raise UsageError(
                f"batch of {batch.shape[0]} sequences does not split into dp={dp} x "
                f"grad_accum={self.config.grad_accum} equal micro-batches; use a multiple of "
                f"{dp * self.config.grad_accum}"
            )
        seq_len = batch.shape[1] - 1
        micros = [self._local(m) for m in batch.chunk(dp)[r].chunk(self.config.grad_accum)]
        tokens = micros[0][0].numel()  # per micro-batch on this rank
        sp = self.config.sequence_parallel and self.dims.tp > 1
        if sp and tokens % self.dims.tp:
            raise UsageError(
                f"sequence parallelism splits a micro-batch's {tokens} tokens over tp={self.dims.tp} "
                f"ranks evenly; choose batch size, grad_accum and seq_len so that tp divides them"
            )
        # the ranks that sum gradients (dp, and cp under context parallelism) count the batch's targets
        targets = torch.stack([(t != IGNORE_INDEX).sum() for _, t, _ in micros]).sum().double()
        count = all_reduce(targets, self.dims.dp_cp_group)
        meta = (
            causal_metadata([seq_len] * micros[0][0].shape[0])
            if self.dims.cp == 1
            else ContextBatch.build(
                self.dims.cp_group, micros[0][0].shape[0], seq_len, self.config.cp_attention, self.device
            )
        )
        io = StageIO(self.dims, self.device, self.config.vpp, self.zero.leaves)
        hidden = self.checkpoint.config.hidden_size
        total = torch.zeros(
            (), dtype=torch.float64, device=self.device
        )  # the loss summed over this rank's tokens (last stage)
        aux_total = torch.zeros((), dtype=torch.float64, device=self.device)  # this rank's share of the aux loss

        def forward(i: int, chunk: int) -> None:
            inputs, targets, positions = micros[i]
            b = inputs.shape[0]
            local = b * len(positions) // (self.dims.tp if sp else 1)  # tokens a stage passes on
            x = inputs.reshape(-1) if io.first_in(chunk) else io.receive(i, chunk, (local, hidden), self.dtype)
            out = self.zero.forward(
                x, positions.repeat(b), meta, [None] * len(self.model.layers), local_logits=True, chunk=chunk
            )  # last virtual stage: [tokens, local vocab] logits
            if io.last_in(chunk):
                loss = vocab_parallel_cross_entropy(out, targets.reshape(-1), self.vocab_start, self.dims.tp_group)
                total.add_(loss.detach().sum().double())
                out = loss.sum() / count
                if self.config.aux_loss_coef and torch.is_grad_enabled():  # pp=1: every layer's statistics here
                    aux = load_balancing_loss(self.moe, self.dims.dp_cp_group)
                    aux_total.add_(aux.detach().double())
                    out = out + self.config.aux_loss_coef * aux
                out = out * scale
            io.produced(i, chunk, out)

        return _Pass(micros, count, io, total, aux_total, forward)

    def evaluate(self, batch: torch.Tensor | list[list[int]]) -> dict:
        """The mean next-token loss of a global batch [batch, seq_len + 1] without training
        (collective, as ``step``: every rank passes the same batch): every micro-batch's forward,
        through the stages in order, and nothing kept for backward."""
        with torch.no_grad():
            run = self._pass(batch, 1.0)
            for i in range(len(run.micros)):
                for chunk in range(self.config.vpp):  # through the virtual stages in order
                    run.forward(i, chunk)
            run.io.flush()
        for block in self.moe:  # an evaluation moves no bias
            block.stats = []
        loss = all_reduce(all_reduce(run.total, self.dims.pp_group), self.dims.dp_cp_group) / run.count
        return {"loss": float(loss), "tokens": int(run.count)}

    def save_state(self, directory: str) -> str:
        """Write what resuming needs after the steps taken so far (collective): float32 master
        weights, AdamW moments and counters as a DCP checkpoint in ``state/step-<n>`` that any
        layout can resume from (state.py: each rank writes what it holds, nothing gathered), then
        rank 0 points ``state/meta.json`` at that folder and removes older ones. A run killed while
        saving leaves meta.json naming the previous, complete folder."""
        root = Path(directory) / "state"
        folder = root / f"step-{self.steps}"
        if self.dims.global_rank == 0 and folder.exists():  # left by a run killed while saving it
            shutil.rmtree(folder)
        _all_ranks_here()
        state.save(self, str(folder))  # collective: returns once every rank's part and the metadata are written
        if self.dims.global_rank == 0:
            meta = root / "meta.json"
            meta.with_suffix(".tmp").write_text(
                json.dumps({"step": self.steps, "folder": folder.name, "layout": self._state_layout()})
            )
            meta.with_suffix(".tmp").replace(meta)
            for old in root.glob("step-*"):
                if old != folder:
                    shutil.rmtree(old)
        _all_ranks_here()
        return str(folder)

    def load_state(self, directory: str) -> int:
        """Resume from ``save_state``'s folder, saved at this layout or any other (dp, pp, cp, tp,
        ZeRO stage, dtype): this rank reads its part of the masters and moments; returns the
        number of steps they had taken. The hyperparameters (lr, betas, eps, weight decay) are
        this run's."""
        root = Path(directory) / "state"
        try:
            meta = json.loads((root / "meta.json").read_text())
        except FileNotFoundError:
            raise UsageError(
                f"{directory!r} holds no training state (no state/meta.json); save one with save_state / --checkpoint"
            ) from None
        steps = state.load(self, str(root / meta["folder"]), directory)
        c = self.config
        for group in self.optimizer.param_groups:  # this run's settings, not the saved ones
            group.update(lr=c.lr, betas=c.betas, eps=c.eps, weight_decay=c.weight_decay)
        return steps

    def _state_layout(self) -> dict:
        c = self.config
        axes = {a: getattr(c.parallel, a) for a in AXES}
        return {"model": str(c.model), **axes, "zero": c.zero, "dtype": self.dtype_name, "device": self.device.type}

    def save(self, directory: str) -> str:
        """Write the trained model as a HF directory (collective; rank 0 writes, see checkpoint.py)."""
        with self.zero.full_weights():
            save(self.model, self.checkpoint, self.dims, directory)
        return directory

    def _local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (inputs [b, n], targets [b, n], positions [n]) of sequences [b, seq_len + 1]:
        every position, or under cp the zig-zag share of them (targets are the next tokens)."""
        seq_len = ids.shape[1] - 1
        positions = (
            torch.arange(seq_len) if self.dims.cp == 1 else zigzag_positions(seq_len, self.dims.cp, self.dims.cp_rank)
        ).to(self.device)
        ids = ids.to(self.device)
        return ids[:, positions], ids[:, positions + 1], positions

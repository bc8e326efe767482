"""Training activation memory per layer, after Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models",
https://arxiv.org/abs/2205.05198 §4 (Table 2) and §5 (selective recomputation).

Their per-layer count for a GPT layer (16-bit activations, 1-byte dropout masks) is
``sbh(34 + 5as/h)`` bytes; under tensor parallelism ``t`` the 24 "split" units and the
attention core divide by ``t`` while 10 units stay replicated unless sequence parallelism
splits them too. This module keeps every term separate so that the same count serves
GPT-style layers (4h GELU MLP, MHA, dropout: exactly Table 2) and Llama-style ones (SwiGLU,
GQA, no dropout). Full recomputation stores only each layer's input (2sbh, /t with SP), as
shardlm's trainer does (``train.trainer.Recomputed`` keeps the sum of the output and the
residual stream, one tensor).

One departure from the paper's layer, as shardlm (and any current trainer) runs it, and as
``benchmarks/train.py`` measures it (saved-tensor bytes of one layer against this count):
fused attention (flash / SDPA) stores no a x s x s softmax, only a float32 log-sum-exp per
head and token (``flash``); ``flash=False`` counts the unfused scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation: none; selective (the attention core, §5, and for a gated MLP its
activation, as shardlm's trainer recomputes it); full (the layer)."""
RECOMPUTE_MODULES = ("mla_up_proj", "mlp")
"""Megatron-Core's recompute modules a plan can add to its recomputation (``--recompute-modules``):
latent attention's up-projections and a dense layer's MLP. Its ``core_attn`` and ``moe_act`` are
what ``selective`` recomputes."""


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """What a layer's stored activations depend on."""

    hidden: int
    """h: model width."""
    heads: int
    """a: query heads."""
    q_dim: int
    """Width of the query (and attention output) projection: heads x head_dim."""
    kv_dim: int
    """Width of K (and of V): KV heads x head_dim (smaller than q_dim under GQA)."""
    ffn: int
    """MLP intermediate width (per token; for MoE: top-k x expert width + shared)."""
    gated: bool = True
    """SwiGLU (gate and up) rather than one up-projection with GELU."""
    dropout: bool = False
    """Dropout after attention softmax and after each block (GPT-3 yes, Llama no)."""
    flash: bool = False
    """Fused attention: a float32 log-sum-exp per head and token instead of the softmax."""
    fused_activation: bool = False
    """The gated activation is one kernel that keeps only its input (gate and up) for backward
    (Megatron's fused SwiGLU, Transformer Engine's); shardlm's eager trainer also keeps silu(gate)."""
    fp8_inputs: bool = False
    """FP8 linear layers keep their inputs' FP8 copies for backward, 1 byte an element (Transformer
    Engine; DeepSeek-V3 §3.3): the QKV, fc1 and down-projection inputs; the attention output
    projection keeps its FP8 copy beside the 16-bit output fused attention keeps."""

    recomputed: frozenset[str] = frozenset()
    """Megatron-Core's recompute modules this layer runs again in backward (``RECOMPUTE_MODULES``):
    ``mla_up_proj`` frees latent attention's Q, K and V after its forward (the up-projections'
    inputs, the latents, are kept as their saved inputs either way); ``mlp`` frees the MLP's
    intermediate rows (its input, the fc1 input, is kept)."""

    @property
    def linear_in(self) -> int:
        """Bytes an element of a linear layer's saved input takes (its FP8 copy under FP8)."""
        return 1 if self.fp8_inputs else 2

    def gated_row_bytes(self, recompute: str) -> int:
        """Bytes a gated MLP keeps for backward per intermediate unit and token: gate and up, then
        silu(gate) (not under a fused activation) and their product (the down projection's input);
        selective recomputation keeps only gate and up and recomputes the rest."""
        if recompute == "selective":
            return 2 + 2
        return 2 + 2 + (0 if self.fused_activation else 2) + self.linear_in

    @classmethod
    def gpt(cls, hidden: int, heads: int) -> LayerShape:
        """The layer Korthikanti et al. count: MHA, 4h GELU MLP, dropout."""
        return cls(hidden=hidden, heads=heads, q_dim=hidden, kv_dim=hidden, ffn=4 * hidden, gated=False, dropout=True)


def layer_activation_bytes(
    shape: LayerShape, *, seq: int, micro_batch: int, tp: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Bytes of activations one layer keeps for backward, per rank, for one micro-batch."""
    s, b, h, t = seq, micro_batch, shape.hidden, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)  # only the layer input (16-bit)
    mask = 1 if shape.dropout else 0
    linear_in = shape.linear_in
    # replicated under TP unless SP splits them along the sequence (Table 2 "10" units): LN in, QKV in,
    # attn-out mask, LN in, fc1 in, mlp mask
    replicated = sbh * (2 + linear_in + mask + 2 + linear_in + mask)
    # split by TP (Table 2 "24" units for GPT): Q, K, V, attention-output-proj input, MLP hidden
    sb = s * b
    qkv = 0 if "mla_up_proj" in shape.recomputed else 2 * shape.q_dim + 2 * shape.kv_dim + 2 * shape.kv_dim
    split = sb * (qkv + 2 * shape.q_dim)
    if shape.fp8_inputs:  # the output projection's FP8 copy of the attention output
        split += sb * shape.q_dim
    if "mlp" not in shape.recomputed:  # else the MLP's rows are made again in backward
        # a gated MLP's rows (LayerShape.gated_row_bytes); fc1's output (GELU input) and GELU's (fc2's input)
        split += sb * shape.ffn * (shape.gated_row_bytes(recompute) if shape.gated else 2 + linear_in)
    # attention core: softmax output (2), its dropout mask (1) and dropout output (2) -> 5as^2b;
    # fused attention: its log-sum-exp, 4 bytes per head and token
    if shape.flash:
        core = shape.heads * s * b * 4
    else:
        core = shape.heads * s * s * b * (2 + (mask + 2 if shape.dropout else 0))
    if recompute == "selective":
        core = 0
    return replicated / (t if sp else 1) + split / t + core / t


def korthikanti_table2(*, s: int, b: int, h: int, a: int, t: int, sp: bool, selective: bool) -> float:
    """Table 2 of Korthikanti et al. in closed form (bytes per layer), for cross-checking."""
    core = 0 if selective else 5 * a * s / (h * t)
    return s * b * h * ((34 / t if sp else 10 + 24 / t) + core)


def largest_chunk(held: int, virtual: int) -> float:
    """The share of a stage's ``held`` layers its largest interleaved chunk holds: 1/v where they split
    evenly, else ceil(held / v) / held (uneven chunks differ by a layer, as Megatron places them)."""
    return math.ceil(held / virtual) / held if held else 1 / virtual


def in_flight_microbatches(
    schedule: str, *, pp: int, num_micro: int, virtual: int = 1, held: int | None = None
) -> float:
    """Micro-batches whose activations the first stage holds at its peak.

    GPipe runs every forward first (m); 1F1B and ZB-H1 cap it at p (Narayanan et al. 2021,
    https://arxiv.org/abs/2104.04473 §2.2; Qi et al. 2023, https://arxiv.org/abs/2401.10241 §3);
    the interleaved schedule holds p(1 + (p-1)/(p v)) = p + (p-1)/v stage-equivalents
    (Korthikanti et al. 2022 §4.2.3, with v model chunks per stage): p of every chunk and p - 1 more
    of one, the largest of the stage's ``held`` layers (``largest_chunk``; 1/v when not given).
    """
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(num_micro)
    if schedule == "interleaved":
        return pp + (pp - 1) * (1 / virtual if held is None else largest_chunk(held, virtual))
    return float(min(pp, num_micro))

"""Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864).

The rotate-half convention of HF checkpoints: the two halves of each head are the
real and imaginary parts (DeepSeek's interleaved pairs are de-interleaved first,
``deinterleave``). Scalings: ``linear`` (position interpolation, Chen et al.
2023), ``llama3`` (Llama 3.1 frequency-dependent scaling; the wavelength bands
follow Meta's reference code and HF's ``_compute_llama3_parameters``) and ``yarn``
(Peng et al. 2023, https://arxiv.org/abs/2309.00071, with DeepSeek's mscale).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardlm.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), then scaled per ``cfg.rope_scaling``. Shape [rotary_dim/2]."""
    d = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "yarn":
        return _yarn(cfg, scaling, inv)
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        # long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
        # the band between them interpolated smoothly
        scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv


def _yarn(cfg: ModelConfig, scaling: dict, inv: torch.Tensor) -> torch.Tensor:
    """YaRN's blend: dims that turn many times within the original context keep their frequency
    (extrapolation), slow ones are divided by ``factor`` (interpolation), a linear ramp between
    (bounds from beta_fast / beta_slow rotations; HF's ``_compute_yarn_parameters``)."""
    d, base, factor = cfg.rotary_dim, cfg.rope_theta, yarn_factor(cfg)
    old_len = scaling["original_max_position_embeddings"]

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over old_len
        return d * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(scaling.get("beta_fast") or 32), dim_of(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv / factor * (1 - keep) + inv * keep


def yarn_factor(cfg: ModelConfig) -> float:
    scaling = cfg.rope_scaling or {}
    return scaling.get("factor") or cfg.max_position_embeddings / scaling["original_max_position_embeddings"]


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(factor) + 1 for factor > 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (1 for the other scalings); DeepSeek's configs give
    mscale and mscale_all_dim, whose ratio it is."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = yarn_factor(cfg), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... -> halves (x0, x2, ...), (x1, x3, ...): an interleaved rotary
    layout in the rotate-half one. Applied to q and k alike, it leaves their dot products as they were."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class Rotary(nn.Module):
    """The cos/sin table of RoPE, built once; ``at(positions)`` looks up one step's rows.

    rotate_half(x) = [-x2, x1] equals roll(x, d/2) * [-1, +1], so the table stores sin
    with that sign folded in and ``apply_rotary`` needs one roll instead of chunk/neg/cat.
    """

    cos: torch.Tensor  # [max_positions, rotary_dim] (buffer)
    sin_signed: torch.Tensor  # [max_positions, rotary_dim] (buffer)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, rotary_dim]
        half = cfg.rotary_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        scale = attention_factor(cfg)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin_signed", emb.sin() * scale * sign, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [tokens, 1, rotary_dim], shared by every layer of the step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] (q and k heads together) -> x * cos + rotate_half(x) * sin.

    Plain multiply and add, not addcmul: a fused multiply-add would round differently from HF.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

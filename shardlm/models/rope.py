"""Rotary position embedding (Su et al. 2021, https://arxiv.org/abs/2104.09864).

The rotate-half convention of HF checkpoints: the two halves of each head are the
real and imaginary parts. Scalings: ``linear`` (position interpolation, Chen et al.
2023) and ``llama3`` (Llama 3.1 frequency-dependent scaling; the wavelength bands
follow Meta's reference code and HF's ``_compute_llama3_parameters``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from shardlm.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/d), then scaled per ``cfg.rope_scaling``. Shape [head_dim/2]."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        return inv / scaling["factor"]
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


class Rotary(nn.Module):
    """The cos/sin table of RoPE, built once; ``at(positions)`` looks up one step's rows.

    rotate_half(x) = [-x2, x1] equals roll(x, d/2) * [-1, +1], so the table stores sin
    with that sign folded in and ``apply_rotary`` needs one roll instead of chunk/neg/cat.
    """

    cos: torch.Tensor  # [max_positions, head_dim] (buffer)
    sin_signed: torch.Tensor  # [max_positions, head_dim] (buffer)

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = cfg.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin_signed", emb.sin() * sign, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [tokens, 1, head_dim], shared by every layer of the step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] (q and k heads together) -> x * cos + rotate_half(x) * sin.

    Plain multiply and add, not addcmul: a fused multiply-add would round differently from HF.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

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
    """The cos/sin table of RoPE, built once; ``at(positions)`` looks up one step's rows."""

    def __init__(self, cfg: ModelConfig, max_positions: int):
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inverse_frequencies(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [tokens, 1, head_dim], shared by every layer of the step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] -> both rotated."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)

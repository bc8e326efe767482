"""RoPE against HF transformers: inverse frequencies (default, linear, llama3) and the
rotation applied to q/k, with HF's own LlamaRotaryEmbedding cos/sin and apply_rotary_pos_emb.

Tolerance: exact (``assert_close(atol=0, rtol=0)``) in float32. shardlm and HF do the
same float32 operations in the same order (theta ** (arange/d), the llama3 band
blend, position * inv_freq, cos/sin, q*cos + rotate_half(q)*sin) with no reduction
whose order could differ, so any difference at all means the formulas differ.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from shardlm.models import rope
from shardlm.models.config import ModelConfig
from shardlm.models.rope import Rotary, inverse_frequencies

EXACT = dict(atol=0.0, rtol=0.0)

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "default_500k": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    # original context small enough that head_dim=64 frequencies fall in all three llama3 bands
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "llama3_8k": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}


def hf_config(rope: dict, head_dim: int = 64) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        num_hidden_layers=1,
        vocab_size=32,
        max_position_embeddings=16384,
        rope_parameters=dict(rope),
        architectures=["LlamaForCausalLM"],
    )


def both(name: str, head_dim: int = 64) -> tuple[LlamaConfig, ModelConfig]:
    hf = hf_config(ROPES[name], head_dim)
    return hf, ModelConfig.from_hf(hf.to_dict())


def hf_inv_freq(hf: LlamaConfig) -> torch.Tensor:
    kind = hf.rope_parameters["rope_type"]
    if kind == "default":
        inv, scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](hf, torch.device("cpu"))
    assert scale == 1.0  # none of these types rescales cos/sin, which Rotary relies on
    return inv


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_inverse_frequencies_equal_hf(name, head_dim):
    hf, cfg = both(name, head_dim)
    assert cfg.head_dim == head_dim
    ours = inverse_frequencies(cfg)
    theirs = hf_inv_freq(hf)
    assert ours.dtype == theirs.dtype == torch.float32
    assert ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, theirs, **EXACT)
    # HF's module agrees with the function we called (the same path the model uses)
    torch.testing.assert_close(LlamaRotaryEmbedding(hf).inv_freq, theirs, **EXACT)


@pytest.mark.parametrize("name", ["linear", "llama3", "llama3_8k"])
def test_scaling_changes_the_frequencies(name):
    # can-fail guard: scaled and unscaled differ, so the comparison above is not vacuous
    _hf, cfg = both(name, 128)
    base = {"rope_type": "default", "rope_theta": ROPES[name]["rope_theta"]}
    plain = inverse_frequencies(ModelConfig.from_hf(hf_config(base, 128).to_dict()))
    scaled = inverse_frequencies(cfg)
    assert not torch.equal(plain, scaled)
    assert torch.all(scaled <= plain)  # every scaling only slows rotations down
    if name == "linear":
        torch.testing.assert_close(scaled, plain / 4.0, **EXACT)


def test_llama3_bands_all_exercised():
    # the 256-context case has high (kept), medium (blended) and low (divided) frequencies
    _, cfg = both("llama3", 64)
    plain = inverse_frequencies(
        ModelConfig.from_hf(hf_config({"rope_type": "default", "rope_theta": 500000.0}).to_dict())
    )
    ratio = plain / inverse_frequencies(cfg)
    kept = torch.isclose(ratio, torch.tensor(1.0))
    divided = torch.isclose(ratio, torch.tensor(8.0))
    blended = ~kept & ~divided
    assert kept.any() and divided.any() and blended.any(), ratio
    assert torch.all((ratio[blended] > 1) & (ratio[blended] < 8))


def rotate(rot: Rotary, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotary's q/k rotation as the model does it: q and k heads side by side, one
    ``apply_rotary`` with the step's (cos, signed sin) from ``rot.at``."""
    qk = rope.apply_rotary(torch.cat([q, k], dim=1), *rot.at(positions, q.dtype))
    return qk[:, : q.shape[1]], qk[:, q.shape[1] :]


@pytest.mark.parametrize("name", list(ROPES))
def test_rotary_matches_hf_apply_rotary_pos_emb(name):
    head_dim, heads, kv_heads = 64, 4, 2
    hf, cfg = both(name, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 31, 255, 256, 1000, 4095, 8191, 12345])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), heads, head_dim, generator=g)  # [tokens, heads, d]
    k = torch.randn(len(positions), kv_heads, head_dim, generator=g)

    rot = Rotary(cfg, max_positions=16384)
    q_ours, k_ours = rotate(rot, positions, q, k)

    emb = LlamaRotaryEmbedding(hf)
    cos, sin = emb(q, positions[None])  # [1, tokens, d]
    # HF layout: [batch, heads, tokens, d]; cos/sin unsqueezed at dim 1
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    q_hf, k_hf = q_hf[0].transpose(0, 1), k_hf[0].transpose(0, 1)

    # also the cos/sin tables themselves
    torch.testing.assert_close(rot.cos[positions], cos[0], **EXACT)
    half = head_dim // 2  # the table folds rotate_half's sign into sin: [-sin, +sin]
    torch.testing.assert_close(rot.sin_signed[positions, :half], -sin[0, :, :half], **EXACT)
    torch.testing.assert_close(rot.sin_signed[positions, half:], sin[0, :, half:], **EXACT)
    torch.testing.assert_close(q_ours, q_hf, **EXACT)
    torch.testing.assert_close(k_ours, k_hf, **EXACT)
    # can-fail guard: the rotation does something (position 0 is the identity, others are not)
    torch.testing.assert_close(q_ours[0], q[0], **EXACT)
    assert (q_ours[1:] - q[1:]).abs().amax() > 1e-2
    # norms are preserved by a rotation (float32 rounding only)
    torch.testing.assert_close(q_ours.norm(dim=-1), q.norm(dim=-1), atol=1e-4, rtol=1e-5)

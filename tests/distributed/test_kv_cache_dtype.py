"""Quantized KV caches: 'int8' (int8 values and a float32 scale per token and head, absmax / 127),
'int4' (two values a byte, a float16 scale and minimum per group of 32 elements of a token's head:
asymmetric; symmetric absmax / 7 measured 1.87 / 0.76 on SmolLM2 below, groups of 16 0.75 / 0.84)
and 'fp8' / 'fp8_e5m2' (float8 e4m3 / e5m2, no scale, as vLLM's fp8 cache without calibration).
Attention reads keys and values back widened to the model's dtype.

Measured error, teacher-forced: every position of a prompt is fed one token a step, so each step
reads all earlier keys and values back from the cache; its logits are compared with the same
model's on a float32 cache (mean |logit difference| over every position and the vocabulary; how
often the top token is the same). Tiny models (33 positions, logits within +-8):

    cache      llama  qwen3  mistral   top-1 same
    int8       0.053  0.030  0.044     0.94-0.97
    int4       0.675  0.460  0.603     0.42-0.64
    fp8        0.270  0.140  0.246     0.70-0.91
    fp8_e5m2   0.481  0.297  0.454     0.64-0.82

SmolLM2 (97 positions, logits within +-38): int8 0.106 (top-1 0.969), fp8 0.278 (0.907),
fp8_e5m2 0.640 (0.825); on a 37-token chat prompt int8 0.152 (0.973), int4 1.180 (0.838), fp8
0.375 (0.919). The tolerances below are those means with ~2x margin; the errors must
also exceed 1e-3, so a cache that silently stayed float32 fails.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import cache_read_logits
from harness.reference import PROMPTS
from shardlm import LLM
from shardlm.errors import UsageError

MEAN_ERROR = {"int8": 0.1, "int4": 1.3, "fp8": 0.5, "fp8_e5m2": 1.0}
TOP1_SAME = {"int8": 0.9, "int4": 0.3, "fp8": 0.6, "fp8_e5m2": 0.5}


def test_exact_cache_read_back_matches_hf(tiny):
    """The float32 cache read back at every position gives HF's logits (the path the quantized
    caches change; mistral: its sliding window is shorter than the prompt)."""
    for name in ("llama", "mistral"):
        ref = tiny(name)
        [logits] = run_ranks(1, cache_read_logits, str(ref.path), 1, PROMPTS[-1])
        torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv", list(MEAN_ERROR))
@pytest.mark.parametrize("name", ["llama", "qwen3", "mistral"])
def test_one_byte_cache_error_is_bounded(tiny, name, kv):
    ref = tiny(name)
    [logits] = run_ranks(1, cache_read_logits, str(ref.path), 1, PROMPTS[-1], kv_cache_dtype=kv)
    err = (logits - ref.logits).abs()
    assert 1e-3 < err.mean() < MEAN_ERROR[kv], f"{kv}: mean |dlogit| {err.mean():.4f}"
    assert (logits.argmax(-1) == ref.logits.argmax(-1)).float().mean() >= TOP1_SAME[kv]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_mla_latent_cache_error_is_bounded(tmp_path_factory, kv):
    """DeepSeek-V3's cache rows hold the latent and the rotary key, quantized as one row (int8: one
    scale for both). Measured: int8 0.055 (top-1 0.94), fp8 0.191 (0.82); held to the same bounds."""
    from harness.moe_reference import cached_tiny_moe

    ref = cached_tiny_moe("deepseek_v3", tmp_path_factory)
    [logits] = run_ranks(1, cache_read_logits, str(ref.path), 1, PROMPTS[-1], kv_cache_dtype=kv)
    err = (logits - ref.logits[-1]).abs()
    assert 1e-3 < err.mean() < MEAN_ERROR[kv], f"{kv}: mean |dlogit| {err.mean():.4f}"
    assert (logits.argmax(-1) == ref.logits[-1].argmax(-1)).float().mean() >= TOP1_SAME[kv]
    with pytest.raises(UsageError, match="latent \\+ rope row=48 does not split"):
        LLM(str(ref.path), kv_cache_dtype="int4", threads=1)


@pytest.mark.parametrize("tp", [2, 3])
def test_int8_cache_under_tensor_parallelism(tiny, tp):
    """Each tp rank quantizes its own heads, each head with its own scales, so tp gives the
    one-process int8 cache's logits (measured: within 1.1e-5 at tp=2 and 3; GQA heads split)."""
    ref = tiny("llama")
    [one] = run_ranks(1, cache_read_logits, str(ref.path), 1, PROMPTS[-1], kv_cache_dtype="int8")
    assert (one - ref.logits).abs().mean() > 1e-3  # quantized, so agreement below is not trivial
    for logits in run_ranks(tp, cache_read_logits, str(ref.path), tp, PROMPTS[-1], kv_cache_dtype="int8"):
        torch.testing.assert_close(logits, one, rtol=1e-4, atol=1e-4)


# bytes of a 16-token block of tiny qwen3: 2 (K, V) x 6 layers x 16 tokens x 2 KV heads x a row of
# head_dim 32 float32 (128 B), 32 fp8 (32 B), 32 int8 + a float32 scale (36 B) or 16 bytes of int4
# pairs + a float16 scale and minimum (20 B); blocks in 1 MiB
@pytest.mark.parametrize(
    "kv, blocks",
    [("auto", 2**20 // 49152), ("fp8", 2**20 // 12288), ("int8", 2**20 // 13824), ("int4", 2**20 // 7680)],
)
def test_one_byte_cache_holds_more_tokens(tiny, kv, blocks):
    with LLM(str(tiny("qwen3").path), kv_cache_dtype=kv, kv_cache_memory=1 << 20, threads=1) as llm:
        assert llm.kv_blocks == blocks


def test_unknown_kv_cache_dtype_is_refused(tiny):
    with pytest.raises(UsageError, match="kv_cache_dtype='int2' is not supported; use auto or one of int8, int4, fp8"):
        LLM(str(tiny("llama").path), kv_cache_dtype="int2")

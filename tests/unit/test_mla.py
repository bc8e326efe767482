"""Multi-head latent attention (DeepSeek-V2/V3) in one process: decode's absorbed form against the
expanded form prefill uses, and the cache that holds only the latent.

Tolerance: float32 ``assert_close`` defaults (rtol 1.3e-6, atol 1e-5): the absorbed form multiplies
W_UK into the query and W_UV after attention, the same products in another order (int8 weights:
see the test).
"""

from __future__ import annotations

import pytest
import torch

from harness.moe_reference import cached_tiny_moe
from shardlm.models.attention import AttentionMetadata, PrefillSeq
from shardlm.models.loader import load_model, open_checkpoint
from shardlm.models.mla import LatentAttention
from shardlm.parallel.dims import ParallelDims

BLOCK = 4


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v2"])
def mla_model(request, tmp_path_factory):
    ref = cached_tiny_moe(request.param, tmp_path_factory)
    return load_model(open_checkpoint(ref.path), ParallelDims())


def _cache(attn: LatentAttention, blocks: int) -> torch.Tensor:
    planes, heads, row = attn.cache_layout()
    return torch.zeros(planes, blocks, BLOCK, heads, row)


@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8-weights"])
@torch.inference_mode()
def test_absorbed_decode_equals_the_expanded_form(mla_model, int8):
    """Two sequences (11 and 6 tokens): all their tokens at once through the expanded form, then
    all but the last as a prompt and the last decoded as a batch over the cached latents (with
    --quantization int8 the absorbed form folds kv_b's dequantized rows)."""
    import copy

    from shardlm.parallel.tensor import quantize_int8

    model = mla_model
    if int8:
        model = copy.deepcopy(mla_model)
        quantize_int8(model)
    attn = model.layers[0].attn
    assert isinstance(attn, LatentAttention)
    lengths, per_seq = [11, 6], 3  # blocks per sequence
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, model.cfg.hidden_size, generator=gen) for n in lengths]
    tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(len(lengths))]

    def slots(i: int, positions: range) -> list[int]:
        return [int(tables[i][p // BLOCK]) * BLOCK + p % BLOCK for p in positions]

    def prefill(cache, parts: list[torch.Tensor]):
        meta = AttentionMetadata(slot_mapping=None, block_size=BLOCK)
        start, slot_list, pos = 0, [], []
        for i, x in enumerate(parts):
            meta.prefills.append(PrefillSeq(start, len(x), len(x), tables[i]))
            start += len(x)
            slot_list += slots(i, range(len(x)))
            pos += range(len(x))
        meta.num_prefill_tokens = start
        meta.slot_mapping = torch.tensor(slot_list)
        positions = torch.tensor(pos)
        return attn(torch.cat(parts), model.rotary.at(positions, torch.float32), meta, cache)

    full = prefill(_cache(attn, per_seq * 2), xs)  # [17, hidden]
    cache = _cache(attn, per_seq * 2)
    prefill(cache, [x[:-1] for x in xs])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slots(i, [n - 1])[0] for i, n in enumerate(lengths)]), block_size=BLOCK
    )
    meta.decode_block_tables = torch.stack(tables)
    meta.decode_context_lens = torch.tensor(lengths)
    meta.decode_max_context = max(lengths)
    positions = torch.tensor([n - 1 for n in lengths])
    last = torch.stack([x[-1] for x in xs])
    decoded = attn(last, model.rotary.at(positions, torch.float32), meta, cache)  # [2, hidden]
    want = torch.stack([full[lengths[0] - 1], full[-1]])
    assert want.abs().max() > 0.1
    # int8: the expanded form's kv_b runs torch's int8 kernel, in bfloat16 (parallel/tensor.py),
    # the absorbed form its dequantized rows in float32: bfloat16's rounding apart (measured 0.03)
    tol = dict(rtol=0, atol=0.1) if int8 else {}
    torch.testing.assert_close(decoded, want, **tol)
    # can fail: a decode that reads another sequence's latents (swapped tables) differs
    meta.decode_block_tables = torch.stack(tables[::-1])
    swapped = attn(last, model.rotary.at(positions, torch.float32), meta, cache)
    assert (swapped - want).abs().max() > 1e-3


def test_the_cache_holds_the_latent_not_the_heads(mla_model):
    """KV bytes per token and layer = (kv_lora_rank + qk_rope_head_dim) x element size, the
    planner's formula, a fraction of what per-head keys and values would take."""
    from shardlm.engine.model_runner import ModelRunner
    from shardlm.plan.roofline import kv_bytes_per_token
    from shardlm.plan.shard import rank_layer

    cfg = mla_model.cfg
    block = ModelRunner.kv_bytes_per_block(mla_model, 16, torch.float32)
    per_token_layer = block / (16 * cfg.num_layers)
    assert per_token_layer == (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    planned = rank_layer(cfg, 0, tp=1)
    assert per_token_layer == kv_bytes_per_token(cfg, planned, 4)
    expanded = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    assert per_token_layer < expanded / 3
    # the planner's attention parameters (two norms included) are the ones the model holds
    layer = mla_model.layers[0]
    held = sum(p.numel() for m in (layer.attn, layer.input_norm, layer.post_norm) for p in m.parameters())
    assert held == planned.attn

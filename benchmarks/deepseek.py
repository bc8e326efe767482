"""DeepSeek-shaped MoE rows for benchmarks/moe.py's table: MLA's latent KV cache and absorbed decode,
and MoE training with the experts split (ep=2) against whole on each rank (ep=1), in the same run.

* KV bytes per token and layer: the engine's cache (``ModelRunner.kv_bytes_per_block``: the latent
  and the rotary key) against what per-head keys and values would take (the expanded form's).
* Decode, one attention layer of DeepSeek-V2-Lite's shape (hidden 2048, 16 heads, kv_lora_rank 512,
  rope 64, nope 128, v 128; float32, one thread): a batch of sequences with contexts of the given
  length in the paged cache, one new token each. "absorbed" is shardlm's decode (W_UK folded into
  the query, attention over the cached latents, W_UV after); "expanded" expands every cached latent
  into per-head keys and values each step, as HF transformers' DeepSeek does; both timed in turns
  (best of --repeats), their outputs checked equal.
* Training: a random DeepSeek-V3-shaped model (hidden 512, 8 routed experts top-2 in 4 groups, a
  shared expert, expert width 512, MLA, 3 layers, the first dense) on 2 CPU ranks x 1 thread, dp=2
  with ep=1 (every rank every expert) and ep=2 (half each, all-to-all), ZeRO-1; tokens per second
  of the best step of --repeats (interleaved), and the share of a step the expert collectives take
  in forward (their backward is the reverse all-to-all, not timed separately).

    python benchmarks/deepseek.py [--context 2048] [--batch 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

BLOCK = 16


def lite_config():
    from shardlm.models.config import ModelConfig

    return ModelConfig(
        family="deepseek_v2",
        vocab_size=1024,
        hidden_size=2048,
        intermediate_size=4096,
        num_layers=1,
        num_heads=16,
        num_kv_heads=16,
        head_dim=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        rope_interleave=True,
    )


def expanded_decode(attn, q_nope, q_pe, cache, tables, lens, context):
    """HF's way: every cached latent expanded into per-head keys and values, then attention."""
    import torch.nn.functional as F

    from shardlm.models.attention import gather_blocks

    n, row = q_nope.shape[0], attn.latent + attn.rope
    ctx = gather_blocks(cache, tables[:, : -(-context // BLOCK)].flatten(), q_nope.dtype, row).view(n, -1, row)
    s = ctx.shape[1]
    kv = attn.kv_b(ctx[..., : attn.latent].reshape(n * s, -1)).view(n, s, attn.num_q, -1)
    k = torch.cat([kv[..., : attn.nope], ctx[:, :, None, attn.latent :].expand(n, s, attn.num_q, attn.rope)], -1)
    v = kv[..., attn.nope :]
    q = torch.cat([q_nope, q_pe], -1)[:, :, None]  # [B, heads, 1, nope + rope]
    mask = (torch.arange(s)[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=attn.scale)
    return o[:, :, 0]  # [B, heads, v]


def decode_rows(context: int, batch: int, repeats: int) -> list[str]:
    from shardlm.engine.model_runner import ModelRunner
    from shardlm.models.mla import LatentAttention, latent_decode_attention
    from shardlm.parallel.dims import ParallelDims

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = lite_config()
    attn = LatentAttention(cfg, ParallelDims(), "layer", torch.float32)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.02)
    per_seq = -(-context // BLOCK)
    planes, heads, row = attn.cache_layout()
    cache = torch.randn(planes, per_seq * batch, BLOCK, heads, row)
    tables = torch.arange(per_seq * batch).view(batch, per_seq)
    lens = torch.full((batch,), context)
    q_nope, q_pe = torch.randn(batch, attn.num_q, attn.nope), torch.randn(batch, attn.num_q, attn.rope)
    w = attn.kv_b.weight.view(attn.num_q, attn.nope + attn.v_dim, attn.latent)

    def absorbed():
        q = torch.cat([torch.einsum("bhn,hnl->bhl", q_nope, w[:, : attn.nope]), q_pe], -1)
        o = latent_decode_attention(q, cache, tables, lens, context, attn.scale, attn.latent)
        return torch.einsum("bhl,hvl->bhv", o, w[:, attn.nope :])

    def expanded():
        return expanded_decode(attn, q_nope, q_pe, cache, tables, lens, context)

    with torch.no_grad():
        torch.testing.assert_close(absorbed(), expanded(), rtol=1e-4, atol=1e-4)
        best = {"absorbed": float("inf"), "expanded": float("inf")}
        for _ in range(repeats):
            for name, fn in (("absorbed", absorbed), ("expanded", expanded)):
                t0 = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t0)

    class One(torch.nn.Module):  # kv_bytes_per_block reads model.layers[0].attn
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Module()])
            self.layers[0].attn = attn

    latent = ModelRunner.kv_bytes_per_block(One(), BLOCK, torch.bfloat16) / BLOCK
    full = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 2
    return [
        f"| KV bytes / token / layer (bf16) | latent {latent:.0f} | expanded {full} | {full / latent:.1f}x fewer |",
        f"| decode step, {batch} seqs x {context} context, 1 layer | absorbed {best['absorbed'] * 1e3:.2f} ms | "
        f"expanded {best['expanded'] * 1e3:.2f} ms | {best['expanded'] / best['absorbed']:.2f}x faster |",
    ]


def build_model(directory: Path) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1024,
        moe_intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=8,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        kv_lora_rank=128,
        q_lora_rank=256,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)


def train_ranks(rank: int, world: int, port: int, path: str, seq: int, repeats: int, results) -> None:
    import torch.distributed as dist

    from shardlm.models.moe import moe_blocks
    from shardlm.train.trainer import TrainConfig, Trainer

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    trainers = {
        ep: Trainer(TrainConfig.of(model=path, dp=2, ep=ep, zero=1, threads=1), rank=rank, world=world) for ep in (1, 2)
    }
    batch = torch.randint(0, 1024, (4, seq + 1), generator=torch.Generator().manual_seed(0))
    best = {ep: (float("inf"), 0.0) for ep in trainers}
    for i in range(repeats + 1):  # the first round warms up
        for ep, trainer in trainers.items():
            blocks = moe_blocks(trainer.model)
            for b in blocks:
                b.experts.comm_s = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            trainer.step(batch)
            took = time.perf_counter() - t0
            if i:
                best[ep] = min(best[ep], (took, sum(b.experts.comm_s for b in blocks) / took))
    results.put((rank, best))
    dist.destroy_process_group()


def train_rows(seq: int, repeats: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        ranks = spawn_ranks(2, train_ranks, tmp, seq, repeats)
    tokens = 4 * seq
    wall = {ep: max(r[ep][0] for r in ranks) for ep in (1, 2)}
    share = {ep: max(r[ep][1] for r in ranks) for ep in (1, 2)}
    return [
        f"| training step, dp2, 4 x {seq} tokens | ep1 {tokens / wall[1]:.0f} tok/s (expert collectives "
        f"{share[1]:.0%}) | ep2 {tokens / wall[2]:.0f} tok/s (all-to-all {share[2]:.0%}) | "
        f"{wall[1] / wall[2]:.2f}x |"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print("| DeepSeek-shaped | shardlm | peer | ratio |")
    print("|---|---|---|---|")
    for line in decode_rows(args.context, args.batch, args.repeats) + train_rows(args.seq_len, args.repeats):
        print(line)


if __name__ == "__main__":
    main()

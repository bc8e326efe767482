"""Is a rank's MoE training step bound by its GPU or by its host? shardlm's trainer on one CUDA GPU
over random Qwen3-MoE models of Qwen3-30B-A3B's widths (hidden 2,048, 32 query and 4 KV heads of
128, experts of 768, top-8) that differ only in their experts: at 8 to 128 experts a rank each token
costs the same FLOPs, while each expert gets fewer of the tokens (4,096 x 8 / experts at the
defaults) and the kernels launched grow with the experts (``measure.experts_block_pass``: 12 an
expert a pass). For each: the step's wall time against its kernels' busy time on the GPU
(``train_profile.profiled``): the difference is the GPU idling between kernels the host has not yet
launched. The planner's price for the same run (no host time on GPUs) stands beside.

This is the measurement docs/plan.md ("What the MoE rows share") asks of a lent GPU: if the idle
time grows with the experts, a host-time model of the step is what the planner's MoE rows lack.

    python benchmarks/moe_train_profile.py [--experts 8 16 32 64 128] [--layers 2] [--seq-len 4096]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch
from train_profile import profiled

WIDTHS = dict(hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4, head_dim=128)
"""Qwen/Qwen3-30B-A3B's config.json widths (shardlm/plan/data/model-qwen3-30b-a3b.json)."""


def build(directory: Path, experts: int, layers: int, vocab: int) -> None:
    """A random Qwen3-MoE with ``experts`` experts of Qwen3-30B-A3B's widths, bfloat16."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        **WIDTHS,
        vocab_size=vocab,
        num_experts=experts,
        num_experts_per_tok=min(8, experts),
        num_hidden_layers=layers,
        intermediate_size=6144,  # (dense MLP layers: none, every layer is sparse)
        max_position_embeddings=40960,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(directory)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768, help="smaller than Qwen3's 151,936: the layers are measured")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="also write every run's profile here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/moe_train_profile.py profiles GPU kernels: it needs a CUDA GPU")
    runs = {}
    for experts in args.experts:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp), experts, args.layers, args.vocab)
            runs[experts] = profiled(tmp, args.batch, args.seq_len, args.steps)
        gc.collect()
        torch.cuda.empty_cache()
        print(f"{experts} experts: {runs[experts]['step_s'] * 1e3:.1f} ms a step", flush=True)
    tokens = args.batch * args.seq_len
    print(f"\n{runs[args.experts[0]]['device']}, {args.layers} layers, {tokens:,} tokens a step, bfloat16, eager")
    print("| experts | tokens an expert | step ms | GPU busy ms | idle ms | kernels | planner ms |")
    print("|---|---|---|---|---|---|---|")
    for experts, r in runs.items():
        planned = tokens / r["planned"]["tokens_per_s"]
        print(
            f"| {experts} | {tokens * min(8, experts) // experts:,} | {r['step_s'] * 1e3:.1f} | "
            f"{r['gpu_busy_s'] * 1e3:.1f} | {(r['step_s'] - r['gpu_busy_s']) * 1e3:.1f} | {r['kernels']:,} | "
            f"{planned * 1e3:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()

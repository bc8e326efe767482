"""Expert parallelism on a small MoE: ep=2 against ep=1 on the same two ranks, in the same run.

A random Mixtral-style model (8 experts, top-2, hidden 512, expert width 1024, 4 layers)
serves a batch of prompts of different lengths with greedy decoding. Each layout runs on
2 CPU ranks of this host (one thread each; shared-memory collectives, or gloo with
SHARDLM_SHM=0), in two pairs that differ only in where the
experts live:

* dp2 ep1 vs dp2 ep2: DP attention (each rank its own prompts); ep1 holds every expert on
  both ranks, ep2 half of them each, with all-to-all dispatch and combine;
* tp2 ep1 vs tp2 ep2: tensor-parallel attention; ep1 computes every expert on both ranks
  (replicated), ep2 half of them each, summed by one all-reduce.

Each ep2 layout also runs re-placed by EPLB from the load its warm-up run observed: "+EPLB"
moves experts only (same memory), "+EPLB+spare" also replicates the hottest experts into one
spare slot per rank. All variants are built side by side on the
same two ranks and timed interleaved (the machine's load drifts). Printed per variant:
output tokens/s of the whole batch (prefill + decode wall time, best of --repeats), its
ratio to the ep1 peer, expert weight memory per rank, the share of a rank's time spent in
expert collectives (all-to-all / all-reduce), and the load imbalance (max/mean tokens per
ep rank, mean over layers). The ranks drive the model with the tests' minimal DP-attention
loop (``tests/harness/moe_rankfns.py``), so the engine's scheduler is not part of the measurement.

    python benchmarks/moe.py [--prompts 16] [--new-tokens 16] [--repeats 3]

DeepSeek's rows (MLA's latent cache and absorbed decode, MoE training at ep1 vs ep2) come from
benchmarks/deepseek.py, in the same table format.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

LAYOUTS = [
    ("dp2 ep1", dict(dp=2, ep=1)),
    ("dp2 ep2", dict(dp=2, ep=2)),
    ("tp2 ep1", dict(tp=2, ep=1)),
    ("tp2 ep2", dict(tp=2, ep=2)),
]
EPLB = {" +EPLB": 0, " +EPLB+spare": 1}  # variant suffix -> spare expert slots per rank


def build_model(directory: Path) -> None:
    import transformers

    cfg = transformers.MixtralConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        initializer_range=0.05,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)


def run_ranks(rank: int, world: int, port: int, path: str, prompts, new_tokens: int, repeats: int, results) -> None:
    """Every layout (and an EPLB copy of each ep2 one) built side by side on this rank, then
    timed interleaved, so a change in the machine's load hits every layout alike."""
    import torch.distributed as dist

    from harness.moe_rankfns import MiniRunner, greedy
    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.models.moe import idle_forward, moe_blocks
    from shardlm.parallel.dims import ParallelDims
    from shardlm.parallel.expert_stats import collect_load, local_load, rebalance_experts

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    ckpt = open_checkpoint(path)
    variants = {}  # name -> (model, dims, runner, prompts of this rank)
    for name, layout in LAYOUTS:
        dims = ParallelDims(**layout).build_mesh("cpu")
        for suffix in ("", *EPLB) if dims.ep > 1 else ("",):
            model = load_model(ckpt, dims)
            mine = prompts[dims.dp_rank :: dims.dp]
            variants[name + suffix] = (
                model,
                dims,
                MiniRunner(model, max(map(len, prompts)) + new_tokens, len(mine)),
                mine,
            )

    def expert_bytes(model) -> int:
        return sum((b.experts.w13.numel() + b.experts.w2.numel()) * 4 for b in moe_blocks(model))

    def run(name: str) -> tuple[float, float]:
        model, _dims, runner, mine = variants[name]
        local_load(model)  # reset the counters
        dist.barrier()
        t0 = time.perf_counter()
        greedy(runner, mine, new_tokens, lambda: idle_forward(model))
        dist.barrier()
        return time.perf_counter() - t0, local_load(model, reset=False)[1]

    out = {}
    for name, (model, dims, _, _) in variants.items():  # warm-up; the ep2 runs' load drives EPLB
        run(name)
        load = collect_load(model, dims)
        out[name] = {
            "bytes": expert_bytes(model),
            "imbalance": load.mean_imbalance,
            "dispatch": moe_blocks(model)[0].experts.dispatch,
        }
        for suffix, spare_per_rank in EPLB.items():
            if name + suffix in variants:
                copy = variants[name + suffix][0]
                rebalance_experts(copy, load, ckpt.source(), redundant=spare_per_rank * dims.ep)
    for _ in range(repeats):
        for name in variants:
            out[name]["best"] = min(out[name].get("best", (float("inf"), 0.0)), run(name))
    for name, (model, dims, _, _) in variants.items():
        if "EPLB" in name:
            out[name]["imbalance"] = collect_load(model, dims).mean_imbalance
    results.put((rank, out))
    dist.destroy_process_group()


def measure(path: str, prompts, new_tokens: int, repeats: int) -> list[dict]:
    return spawn_ranks(2, run_ranks, path, prompts, new_tokens, repeats)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 2048, (16 + 48 * i // max(args.prompts - 1, 1),), generator=g).tolist()
        for i in range(args.prompts)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp))
        ranks = measure(tmp, prompts, args.new_tokens, args.repeats)
    tokens = args.prompts * args.new_tokens
    wall = {n: max(r[n]["best"][0] for r in ranks) for n in ranks[0]}
    print(
        f"MoE: 8 experts top-2, hidden 512, expert width 1024, 4 layers; {args.prompts} prompts of 16-64 tokens, "
        f"{args.new_tokens} new tokens each; 2 CPU ranks x 1 thread "
        f"(SHARDLM_SHM={os.environ.get('SHARDLM_SHM', '')!r}); best of {args.repeats}, layouts interleaved"
    )
    print(
        "| layout | dispatch | expert MB/rank | tok/s | vs ep1 peer | expert-collective share | imbalance (max/mean) |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in ranks[0]:
        peer = n.split(" ")[0] + " ep1"
        share = max(r[n]["best"][1] / r[n]["best"][0] for r in ranks)
        print(
            f"| {n} | {ranks[0][n]['dispatch']} | {max(r[n]['bytes'] for r in ranks) / 2**20:.1f} | "
            f"{tokens / wall[n]:.1f} | {wall[peer] / wall[n]:.2f}x | {share:.0%} | {ranks[0][n]['imbalance']:.3f} |"
        )


if __name__ == "__main__":
    main()

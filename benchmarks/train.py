"""Training SmolLM2: shardlm's step against HF transformers' in the same run, and the model
state each ZeRO stage holds per rank against ZeRO's formula.

1. Step time, one process: HF transformers (its forward, torch's cross-entropy, backward,
   clip_grad_norm_, AdamW) and shardlm's Trainer (dp=1, tp=1) on the same batches, timed in
   turns (median of --repeats); their first losses are printed side by side.
2. Activation recomputation, one rank: a step of 4 x 512 tokens without and with "full"
   recompute (each layer's forward again in backward), each in a fresh process: peak resident
   memory and step time.
3. Activations per layer, one process, bfloat16: the bytes a decoder layer saves for backward
   (distinct storages seen by autograd's saved-tensor hooks, parameters and tensors shared with
   the next layer left out) next to the planner's count (plan/activations.py), without, with
   selective (the SwiGLU activation) and with full recomputation.
4. ZeRO at dp=2: one step of each stage over two ranks; the bytes of weights, gradients (at their
   peak, after backward) and Adam state a rank holds, measured, next to the formula
   (plan/zero.py, float32 Adam: 4 + 4 + 8 bytes per parameter, sharded as each stage says).

    python benchmarks/train.py [--batch 4] [--seq-len 128] [--repeats 3] [--skip-zero] [--skip-recompute]
                               [--skip-activations]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import load_note


def hf_model():
    from transformers import AutoModelForCausalLM

    from shardlm.models.registry import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).train()


def hf_step(model, opt, batch) -> float:
    logits = model(batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def step_times(args) -> None:
    from shardlm.train.trainer import TrainConfig, Trainer

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 49152, (args.batch, args.seq_len + 1), generator=g) for _ in range(args.repeats + 1)]
    hf = hf_model()
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95))
    ours = Trainer(TrainConfig(model="smollm2", lr=1e-5))
    times = {"HF transformers": [], "shardlm": []}
    first = {}
    for i, b in enumerate(batches):  # the first round warms both up and is not timed
        for name, run in (("HF transformers", lambda: hf_step(hf, opt, b)), ("shardlm", lambda: ours.step(b)["loss"])):
            start = time.perf_counter()
            loss = run()
            if i == 0:
                first[name] = loss
            else:
                times[name].append(time.perf_counter() - start)
                print(f"  round {i}/{args.repeats}  {name}: {times[name][-1]:.2f} s  ({load_note()})", flush=True)
    tokens = args.batch * args.seq_len
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nfirst-step loss: HF {first['HF transformers']:.5f}, shardlm {first['shardlm']:.5f}")
    for name, t in med.items():
        print(f"{name:16s} {t:6.2f} s/step  {tokens / t:7.1f} tok/s")
    print(f"shardlm / HF step throughput: {med['HF transformers'] / med['shardlm']:.2f}x   ({load_note()})")


def recompute_memory() -> None:
    from shardlm.launch import LocalRanks
    from shardlm.train.trainer import TrainConfig, Trainer

    batch = torch.randint(0, 49152, (4, 513), generator=torch.Generator().manual_seed(2)).tolist()
    print("\nactivation recomputation, 1 rank, 4 x 512 tokens: peak RSS and the second step's time")
    got = {}
    for mode in ("none", "full"):
        ranks = LocalRanks(1, Trainer.spawned, (TrainConfig(model="smollm2", recompute=mode),), timeout_s=600)
        try:
            ranks.collect("ready")
            ranks.call("step", batch)
            got[mode] = ranks.call("step", batch)[0]
        finally:
            ranks.close()
        print(
            f"  {mode:5s} peak RSS {got[mode]['max_rss_bytes'] / 2**30:.2f} GiB, step {got[mode]['seconds']:.2f} s",
            flush=True,
        )
    saved = (got["none"]["max_rss_bytes"] - got["full"]["max_rss_bytes"]) / 2**30
    slower = got["full"]["seconds"] / got["none"]["seconds"]
    print(f"full recompute: {saved:.2f} GiB less at peak, step time {slower:.2f}x")


def activation_bytes() -> None:
    from shardlm.plan.activations import layer_activation_bytes
    from shardlm.plan.memory import layer_shape
    from shardlm.plan.roofline import ModelCosts
    from shardlm.train.measure import layer_activations
    from shardlm.train.trainer import TrainConfig, Trainer

    print("\nactivations a layer saves for backward, SmolLM2 bfloat16: measured / planner (MiB)")
    print(f"{'batch x seq':>12} {'recompute':>9} {'measured':>9} {'planner':>8} {'ratio':>6}")
    for b, seq in ((2, 256), (4, 512)):
        for recompute in ("none", "selective", "full"):
            trainer = Trainer(TrainConfig(model="smollm2", dtype="bfloat16", recompute=recompute))
            batch = torch.randint(0, 49152, (b, seq + 1), generator=torch.Generator().manual_seed(4))
            got = layer_activations(trainer, batch, layer=3)
            costs = ModelCosts(trainer.checkpoint.config)
            want = layer_activation_bytes(layer_shape(costs, False), seq=seq, micro_batch=b, recompute=recompute)
            print(
                f"{f'{b} x {seq}':>12} {recompute:>9} {got / 2**20:9.2f} {want / 2**20:8.2f} {got / want:6.3f}",
                flush=True,
            )


def zero_memory(args) -> None:
    from shardlm.launch import LocalRanks
    from shardlm.plan.zero import model_states
    from shardlm.train.trainer import TrainConfig, Trainer

    batch = torch.randint(0, 49152, (2, args.seq_len + 1), generator=torch.Generator().manual_seed(1)).tolist()
    print("\nZeRO at dp=2, SmolLM2 float32 + AdamW: MiB per rank, measured / formula")
    print(f"{'stage':>5} {'weights':>17} {'gradients':>17} {'Adam state':>17} {'total':>17} {'ratio':>6}")
    for stage in (0, 1, 2, 3):
        ranks = LocalRanks(2, Trainer.spawned, (TrainConfig.of(model="smollm2", dp=2, zero=stage),), timeout_s=300)
        try:
            params = ranks.collect("ready")[0]["params"]
            held = ranks.call("step", batch)[0]["state_bytes"]
        finally:
            ranks.close()
        want = model_states(params, dp=2, stage=stage, param_bytes=4, grad_bytes=4, state_bytes=8)
        got = [held["weights"], held["gradients"], held["optimizer"]]
        pairs = list(zip(got, [want.weights, want.gradients, want.optimizer])) + [(sum(got), want.total)]
        cells = " ".join(f"{g / 2**20:7.1f} / {w / 2**20:7.1f}" for g, w in pairs)
        print(f"{stage:>5} {cells} {sum(got) / want.total:6.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds (median reported)")
    ap.add_argument("--skip-zero", action="store_true", help="leave out the ZeRO memory table")
    ap.add_argument("--skip-recompute", action="store_true", help="leave out the recomputation comparison")
    ap.add_argument("--skip-activations", action="store_true", help="leave out the per-layer activation count")
    args = ap.parse_args()
    print(f"SmolLM2-135M float32 training, batch {args.batch} x {args.seq_len} tokens; {load_note()}", flush=True)
    step_times(args)
    if not args.skip_recompute:
        recompute_memory()
    if not args.skip_activations:
        activation_bytes()
    if not args.skip_zero:
        zero_memory(args)


if __name__ == "__main__":
    main()

"""Weight offload on a GPU (``--cpu-offload-gb``): decode speed and GPU memory against the same
model held whole on the GPU, and against the formula's floor.

The floor: each decode step copies every offloaded byte over the host link once (one layer ahead,
overlapped with the layer before), so a step takes at least offloaded bytes / the pinned
host-to-device bandwidth, which this script measures in the same run. A run at the floor has hidden
all its compute behind the copies; the ratio printed is floor time / measured time (1.0 = at it).

The model is a random Llama of the given shape (speed does not depend on the values), saved once
to --dir; bfloat16; prompts of 16 random tokens; decode tok/s over --tokens tokens at each batch,
engines loaded together and timed in turns (best of --repeats). The resident engine runs eagerly
too, so that the only difference is the copies.

    python benchmarks/offload.py [--hidden 2048 --layers 16 --intermediate 5632] [--offload 0.5,1]
                                 [--batch 1,16] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from decode import best_in_turns

from shardlm import LLM, SamplingParams


def build(directory: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> Path:
    """A random Llama of this shape as a HF directory (once: kept across runs)."""
    import transformers

    if (directory / "config.json").exists():
        return directory
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        vocab_size=vocab,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def h2d_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of one pinned host-to-device copy of ``nbytes`` (best of ``repeats``)."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/shardlm-offload-model"))
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--offload", default="0.5,1", help="GiB offloaded, comma-separated")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/offload.py needs a CUDA GPU: --cpu-offload-gb keeps GPU weights on the host")
    path = str(build(args.dir, args.hidden, args.layers, args.intermediate, args.vocab))
    gbs = h2d_gbs()
    print(f"{torch.cuda.get_device_name()}; pinned host-to-device copy: {gbs:.1f} GB/s")
    rng = random.Random(0)
    engines = {}
    for gib in [0.0] + [float(g) for g in args.offload.split(",")]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        llm = LLM(path, dtype="bfloat16", enforce_eager=True, cpu_offload_gb=gib, kv_cache_memory=1 << 30)
        engines[gib] = (llm, torch.cuda.memory_allocated() - before, llm.offloaded_bytes[0])
    print(
        f"{'offload GiB':>11} {'batch':>5} {'GPU GiB':>8} {'host GiB':>8} {'tok/s':>8} {'vs resident':>11} {'floor':>8}"
    )
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = [[rng.randrange(args.vocab) for _ in range(16)] for _ in range(batch)]

        def run(llm, n, prompts=prompts):
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))

        rates = best_in_turns(
            {gib: (lambda n, llm=llm: run(llm, n)) for gib, (llm, _, _) in engines.items()}, args.tokens, args.repeats
        )
        for gib, (_, took, hosted) in engines.items():
            step = 1 / rates[gib]  # seconds per decode step (decode_rate counts steps: tokens of one sequence)
            floor = hosted / (gbs * 1e9)
            print(
                f"{gib:>11} {batch:>5} {took / 2**30:>8.2f} {hosted / 2**30:>8.2f} {batch * rates[gib]:>8.1f} "
                f"{rates[gib] / rates[0.0]:>10.2f}x {floor / step if hosted else float('nan'):>8.2f}"
            )
    for llm, _, _ in engines.values():
        llm.close()


if __name__ == "__main__":
    main()

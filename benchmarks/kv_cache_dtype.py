"""What a one-byte KV cache costs in accuracy and buys in tokens, on SmolLM2.

Teacher-forced: a chat prompt plus 60 fixed random tokens is fed one token a step, so every
step reads all earlier keys and values back from the cache (as decoding does); the logits at
every position are compared with the same model's on a float32 cache. Per cache dtype: mean and
max |logit difference|, how often the top token is the same, and KV-cache tokens per GiB.

    python benchmarks/kv_cache_dtype.py [--dtypes int8,fp8,fp8_e5m2]
"""

from __future__ import annotations

import argparse

import torch

from shardlm.engine.config import EngineConfig
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.worker import Worker

QUESTION = "Explain tensor parallelism in one paragraph."


def worker(kv_cache_dtype: str) -> Worker:
    config = EngineConfig(model="smollm2", kv_cache_dtype=kv_cache_dtype, device="cpu")
    return Worker(config, rank=0, world=1, local_rank=0, local_world=1, init_method=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="int8,fp8,fp8_e5m2")
    args = ap.parse_args()
    exact = worker("auto")
    tok = exact.checkpoint.tokenizer()
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    prompt += torch.randint(100, 1000, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = exact.prompt_logits(prompt, chunk=1)
    per_token = ModelRunner.kv_bytes_per_block(exact.model, 1, torch.float32)
    print(f"SmolLM2, {len(prompt)} positions teacher-forced, logits within +-{ref.abs().max():.1f}; "
          f"float32 cache: {2**30 // per_token} tokens per GiB")
    print(f"{'cache':<10} {'mean |dlogit|':>13} {'max':>7} {'top-1 same':>11} {'tokens/GiB':>11}")
    for name in args.dtypes.split(","):
        w = worker(name)
        got = w.prompt_logits(prompt, chunk=1)
        err = (got - ref).abs()
        same = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        per_token = ModelRunner.kv_bytes_per_block(w.model, 1, w.config.kv_torch_dtype)
        print(f"{name:<10} {err.mean():>13.4f} {err.max():>7.3f} {same:>10.1%} {2**30 // per_token:>11}")


if __name__ == "__main__":
    main()

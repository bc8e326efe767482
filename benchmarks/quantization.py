"""What quantization costs in accuracy and buys in memory and speed, on SmolLM2.

Accuracy, teacher-forced: a chat prompt plus 60 fixed random tokens is fed one token a step, so
every step reads all earlier keys and values back from the KV cache (as decoding does); the
logits at every position are compared with the same model's in float32 with a float32 cache.
Per setting: mean and max |logit difference|, and how often the top token is the same.

Table 1, KV-cache element types (``kv_cache_dtype``): KV-cache tokens per GiB.
Table 2, weight-only int8 and int4 (``quantization="int8"``, ``"int4"``: here SmolLM2's own Q4_1
blocks, the file's linear layers being Q4_1) in float32 and bfloat16: parameter MiB, and decode
tok/s at batch 1 and 32 (one thread) against the same dtype unquantized, loaded together and timed
in turns (best of --repeats).

    python benchmarks/quantization.py [--kv int8,fp8,fp8_e5m2] [--weights int8,int4] [--repeats 3] [--tokens 32]
"""

from __future__ import annotations

import argparse

import torch
from decode import decode_rate

from shardlm import LLM, SamplingParams
from shardlm.engine.config import EngineConfig
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.worker import Worker

QUESTION = "Explain tensor parallelism in one paragraph."


def worker(**options) -> Worker:
    config = EngineConfig.of(model="smollm2", device="cpu", **options)
    return Worker(config, rank=0, world=1, local_rank=0, local_world=1, init_method=None)


def errors(got: torch.Tensor, ref: torch.Tensor) -> str:
    err = (got - ref).abs()
    return f"{err.mean():>13.4f} {err.max():>7.3f} {(got.argmax(-1) == ref.argmax(-1)).float().mean().item():>10.1%}"


def batch_rate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Decode tok/s over all of ``prompts`` decoding together (prefill and first token excluded)."""
    return len(prompts) * decode_rate(
        lambda n: llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)), tokens
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="int8,fp8,fp8_e5m2", help="KV-cache dtypes to compare with float32 ('' for none)")
    ap.add_argument("--weights", default="int8,int4", help="weight quantizations to compare with float")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed per run")
    args = ap.parse_args()
    exact = worker()
    tok = exact.checkpoint.tokenizer()
    chat = tok.encode_chat([{"role": "user", "content": QUESTION}])
    prompt = chat + torch.randint(100, 1000, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = exact.prompt_logits(prompt, chunk=1)
    per_token = ModelRunner.kv_bytes_per_block(exact.model, 1, torch.float32)
    print(
        f"SmolLM2, {len(prompt)} positions teacher-forced, logits within +-{ref.abs().max():.1f}; "
        f"torch {torch.__version__}\n"
    )
    print(f"{'KV cache':<10} {'mean |dlogit|':>13} {'max':>7} {'top-1 same':>11} {'tokens/GiB':>11}")
    print(f"{'float32':<10} {'-':>13} {'-':>7} {'-':>11} {2**30 // per_token:>11}")
    for name in filter(None, args.kv.split(",")):
        w = worker(kv_cache_dtype=name)
        per_token = ModelRunner.kv_bytes_per_block(w.model, 1, w.config.kv_torch_dtype)
        print(f"{name:<10} {errors(w.prompt_logits(prompt, chunk=1), ref)} {2**30 // per_token:>11}", flush=True)

    print(
        f"\n{'weights':<16} {'mean |dlogit|':>13} {'max':>7} {'top-1 same':>11} {'MiB':>7} "
        f"{'tok/s b=1':>10} {'b=32':>7}"
    )
    for dtype in ("float32", "bfloat16"):
        quants = [None, *filter(None, args.weights.split(","))]
        llms = {q: LLM("smollm2", dtype=dtype, quantization=q, threads=1) for q in quants}
        try:
            best = {(q, b): 0.0 for q in llms for b in (1, 32)}
            for _ in range(args.repeats):
                for q, llm in llms.items():
                    for b in (1, 32):
                        best[q, b] = max(best[q, b], batch_rate(llm, [chat] * b, args.tokens))
            for q, llm in llms.items():
                got = llm.worker.prompt_logits(prompt, chunk=1)
                name = f"{dtype}{' ' + q if q else ''}"
                print(
                    f"{name:<16} {errors(got, ref)} {llm.param_bytes[0] / 2**20:>7.1f} {best[q, 1]:>10.1f} "
                    f"{best[q, 32]:>7.1f}",
                    flush=True,
                )
        finally:
            for llm in llms.values():
                llm.close()


if __name__ == "__main__":
    main()

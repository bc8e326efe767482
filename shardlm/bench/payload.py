"""What lower-precision all-reduce payloads do to SmolLM2: errors per call and per token.

In one process, every RowParallelLinear of SmolLM2 (float32) computes its output as the
tp ranks would: the input columns split in ``tp`` parts, one partial product each,
then summed. Each partial is passed through ``compress.encode``/``decode`` before the
sum, exactly what ``all_reduce(..., payload=)`` does between ranks, so the errors are
those of a real tp run, without the ranks. Reported per payload: the relative error of
the reduced outputs (||got - exact|| / ||exact|| over all 60 calls per token, mean and
max), the largest logit difference on a prompt, and how many of the greedy tokens match.
"""

from __future__ import annotations

import contextlib

from shardlm.parallel import compress
from shardlm.parallel.collectives import split_sizes
from shardlm.parallel.tensor import RowParallelLinear, linear


@contextlib.contextmanager
def emulated_tp(tp: int, payload: str | None, stats: list[float]):
    """Patch RowParallelLinear.forward to sum tp partials sent in ``payload`` (None: float32)."""
    original = RowParallelLinear.forward

    def forward(self, x):
        sizes = split_sizes(self.weight.shape[1], tp)
        parts = [linear(xs, ws) for xs, ws in zip(x.split(sizes, -1), self.weight.split(sizes, -1))]  # [t, out]
        exact = sum(p.double() for p in parts)
        if payload is not None:
            parts = [compress.decode(compress.encode(p, payload), payload, p.numel()).view_as(p) for p in parts]
        y = parts[0].float().clone()
        for p in parts[1:]:
            y += p
        stats.append(((y.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item())
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    setattr(RowParallelLinear, "forward", forward)  # noqa: B010 (mypy refuses assigning to a method)
    try:
        yield
    finally:
        setattr(RowParallelLinear, "forward", original)  # noqa: B010


def payload_errors(
    *,
    tp: int = 2,
    tokens: int = 32,
    prompt: str = "Explain tensor parallelism in one paragraph.",
    payloads=(None, "bf16", "int8"),
) -> list[dict]:
    from shardlm.engine.llm import LLM
    from shardlm.engine.sampling import SamplingParams

    llm = LLM("smollm2", dtype="float32")
    ids = llm.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    reference = llm.generate([ids], params)[0].token_ids
    worker = llm.worker
    assert worker is not None  # one process: the worker runs in this one
    ref_logits = worker.prompt_logits(ids)
    rows = []
    for payload in payloads:
        stats: list[float] = []
        with emulated_tp(tp, payload, stats):
            got = llm.generate([ids], params)[0].token_ids
            logits = worker.prompt_logits(ids)
        same = next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), len(reference))
        rows.append(
            dict(
                payload=payload or "float32",
                tp=tp,
                calls=len(stats),
                rel_err_mean=sum(stats) / len(stats),
                rel_err_max=max(stats),
                max_logit_diff=(logits - ref_logits).abs().max().item(),
                greedy_match=f"{same}/{len(reference)}",
                bytes_vs_float32=compress.encoded_bytes(576, payload) / (4 * 576) if payload else 1.0,
            )
        )
    llm.close()
    return rows


def payload_table(rows: list[dict]) -> str:
    lines = [
        f"{'payload':<8} {'bytes':>6} {'rel err mean':>12} {'rel err max':>11} {'max |dlogit|':>12} {'greedy same':>11}"
    ]
    for r in rows:
        lines.append(
            f"{r['payload']:<8} {r['bytes_vs_float32']:>6.2f} {r['rel_err_mean']:>12.2e} "
            f"{r['rel_err_max']:>11.2e} {r['max_logit_diff']:>12.2e} {r['greedy_match']:>11}"
        )
    return "\n".join(lines)

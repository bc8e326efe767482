"""Memory traffic of a training step's memory-bound operators: the time a step spends outside its
matrix products and attention core.

A decoder layer's norms, rotary embedding, SwiGLU, residual adds, casts and copies, forward and
backward, each read and write whole activations: bytes that grow with the tokens and the layer's
widths, not with its FLOPs. In a small model they outweigh the matrix products (measured on an
H100: docs/performance.md, "On a GPU"). So do the loss over the vocabulary and the optimizer step.

The coefficients are counted, not fitted: ``shardlm.train.measure.traffic_coefficients`` runs
shardlm's trainer on tiny Llama models that differ in one width at a time and adds up every such
operator's tensor inputs and outputs (a TorchDispatchMode); the counts are exactly linear in the
widths. ``tests/distributed/test_plan_traffic.py`` recounts them. The planner times the bytes at
the device's streaming rate (``GpuSpec.mem_Bps``). Kernels that fuse these operators (Megatron's
fused bias-GeLU and layernorm, inductor) move fewer bytes; the counts are shardlm's eager trainer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.plan.errors import PlanError


@dataclass(frozen=True)
class LayerTraffic:
    """Bytes per token of one decoder layer: per hidden unit, per intermediate unit (SwiGLU), per
    query width (heads x head_dim), per KV width, and a constant."""

    hidden: float
    intermediate: float
    query: float
    kv: float
    const: float

    def per_token(self, hidden: float, intermediate: float, query: float, kv: float) -> float:
        return self.hidden * hidden + self.intermediate * intermediate + self.query * query + self.kv * kv + self.const


# traffic_coefficients("bfloat16"/"float32", recompute="none" / "full"); forward = what full
# recomputation adds (the forward run again), backward = the rest
_NONE = {"bf16": LayerTraffic(328, 36, 60, 76, 248), "fp32": LayerTraffic(280, 72, 120, 152, 376)}
_FULL = {"bf16": LayerTraffic(450, 46, 78, 98, 400), "fp32": LayerTraffic(372, 92, 156, 196, 592)}
_ENDS = {"bf16": (68, 156, 722.5), "fp32": (56, 124, 530.5)}
_PER_PARAM = {"bf16": 110, "fp32": 108}
# routed_pair_traffic(dtype): (forward, backward), the same at any number of experts a rank
_PAIR = {"bf16": (22, 28), "fp32": (44, 56)}

KERNELS = ("shardlm", "fused")
"""Whose memory-bound kernels a plan assumes. shardlm: the bytes counted from shardlm's eager
trainer (above). fused: each of a fused implementation's kernels reads its inputs and writes its
outputs once, as Megatron-LM's fused layernorm with the residual add, fused rotary, fused
bias-SwiGLU / GeLU, fused permutation and fused Adam do (the published training rows ran so): per token a layer's
forward moves 8 hidden-wide tensors (the two norms, each reading the residual and a matmul's
output and writing the new residual and its normed copy), the rotary query and key in and out, and
the activation's input and output (SwiGLU: 2 intermediate-wide in, 1 out; GeLU 1 and 1); backward
about twice that (10 hidden-wide, rotary's gradients, the activation's 5 or 3); an MoE layer copies
each routed (token, expert) pair's hidden row into expert order (reading the token's row, writing
the pair's) and its output back (reading it, adding it into its token's row), and backward the
same two for the gradients (Megatron's ``--moe-permute-fusion``: 4 hidden-wide a pair each way);
the loss reads the logits and writes their gradient; Adam reads the float32 gradient, master and
both moments and writes the three and the 16-bit weight (30 bytes a parameter)."""


@dataclass(frozen=True)
class Profile:
    """Bytes the memory-bound operators move: per token of a layer (forward, backward), per token
    of the model's ends (per vocabulary entry, per hidden unit, constant: the embedding, final norm,
    LM head and loss), per parameter of the optimizer step (gradient accumulation and norm, AdamW,
    the copy back to the compute dtype), and per hidden unit of each routed (token, expert) pair of
    an MoE layer (forward, backward: the dispatch's copies into expert order and back)."""

    forward: LayerTraffic
    backward: LayerTraffic
    ends: tuple[float, float, float]
    per_param: float
    pair: tuple[float, float]

    def ends_per_token(self, vocab: float, hidden: float) -> float:
        """``vocab``: the rank's rows of the LM head."""
        return self.ends[0] * vocab + self.ends[1] * hidden + self.ends[2]


def profile(kernels: str, dtype: str, gated: bool = True) -> Profile:
    """The traffic of ``kernels`` (``KERNELS``) at the planner's ``dtype``: fp16 and fp8 (whose
    activations and elementwise work stay 16-bit) as bf16."""
    if kernels not in KERNELS:
        raise PlanError(f"kernels={kernels!r} is not one of {', '.join(KERNELS)}")
    t = "fp32" if dtype == "fp32" else "bf16"
    if kernels == "fused":
        a = 4 if t == "fp32" else 2
        f_in, b_in = (3, 5) if gated else (2, 3)
        return Profile(
            LayerTraffic(8 * a, f_in * a, 2 * a, 2 * a, 0),
            LayerTraffic(10 * a, b_in * a, 2 * a, 2 * a, 0),
            (2 * a, 6 * a, 0),
            30,
            (4 * a, 4 * a),
        )
    full, none = _FULL[t], _NONE[t]
    fwd = LayerTraffic(*(x - y for x, y in zip(_fields(full), _fields(none))))
    bwd = LayerTraffic(*(x - y for x, y in zip(_fields(none), _fields(fwd))))
    return Profile(fwd, bwd, _ENDS[t], _PER_PARAM[t], _PAIR[t])


def _fields(t: LayerTraffic) -> tuple[float, ...]:
    return (t.hidden, t.intermediate, t.query, t.kv, t.const)

"""What a training step keeps and moves, measured: the checks on the planner's activation count
and memory traffic.

``saved_for_backward()`` records, while it is active, every tensor autograd saves (through
``save_for_backward`` and the built-in ops' own saving) by the storage it lives in, so views of
one tensor count once and a tensor's whole storage counts even where only a view is saved.
``layer_activations`` wraps decoder layers' forwards in it and runs one training step.

``TrafficCounter`` adds up the bytes every memory-bound operator of a step reads and writes (its
tensor inputs and outputs; matrix products and attention, which the planner prices by their
FLOPs, and views, which move nothing, left out). ``traffic_coefficients`` counts steps of tiny
Llama models that differ in one dimension at a time and solves for the bytes per token of a decoder
layer as a function of its widths, of the LM head and loss per vocabulary entry, and of the
optimizer step per parameter: the planner's ``plan.traffic`` constants, which
``tests/distributed/test_plan_traffic.py`` holds to this count. ``routed_pair_traffic`` counts
what an MoE layer's experts block moves per routed (token, expert) pair and hidden unit, given
top-1 and top-2 choices at two widths.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Set
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@contextlib.contextmanager
def saved_for_backward(exclude: Set[int] = frozenset()) -> Iterator[dict[int, int]]:
    """Yields {storage address: bytes} of the tensors saved for backward inside the block, less
    the storages in ``exclude`` (e.g. the parameters')."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def layer_activations(trainer, batch: torch.Tensor, layer: int) -> int:
    """Bytes that decoder layer ``layer`` (of this rank's model, not the last) saves for backward
    in one ``trainer.step(batch)``, parameters left out, and tensors the next layer saves too
    (the rotary tables every layer shares)."""
    if trainer.zero.stage == 3:  # the innermost saved-tensor hook wins: this one would displace ZeRO-3's
        raise ValueError(
            "layer_activations measures ZeRO stages 0-2: under ZeRO-3 its hook would replace the "
            "one that drops gathered weights, and count (and keep) them"
        )
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    counts: list[dict[int, int]] = []
    for module in trainer.model.layers[layer : layer + 2]:

        def counted(*args, forward=module.forward, **kwargs):
            with saved_for_backward(params) as saved:
                out = forward(*args, **kwargs)
            counts.append(saved)
            return out

        module.forward = counted
    try:
        trainer.step(batch)
    finally:
        for module in trainer.model.layers[layer : layer + 2]:
            del module.forward  # the class's forward again
    mine, nxt = counts[0], counts[1]
    return sum(n for ptr, n in mine.items() if ptr not in nxt)


MOVES_NOTHING = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "expand", "permute", "transpose", "t",
    "slice", "select", "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind",
    "narrow", "unflatten", "flatten", "diagonal", "view_as", "lift_fresh", "empty", "empty_like",
    "empty_strided", "new_empty", "new_empty_strided", "_record_function_enter_new", "_record_function_exit"
})  # fmt: skip
"""Operators that make views or uninitialised memory: no bytes move."""
PRICED_BY_FLOPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward"
})  # fmt: skip
"""Matrix products and the attention core: the planner times them by FLOPs (``plan.roofline``)."""


WRITE_ONLY = frozenset({"copy_", "fill_", "zero_"})
"""In-place operators that overwrite their tensor without reading it."""


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written by the memory-bound operators run inside it (``bytes``), by
    operator name (``by_op``): each tensor argument read once; one the operator mutates (its
    schema says so: in-place ops, foreach ops, ``out=``) read and written, or only written where
    it is overwritten (``WRITE_ONLY``, ``out=``); each output that is new memory written once."""

    def __init__(self):
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.kernels = 0
        """Operators run that are not views or allocations (``MOVES_NOTHING``): on a GPU, kernels
        launched (matrix products included)."""

    @property
    def bytes(self) -> int:
        return sum(self.by_op.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__.split(".")[0]
        self.kernels += name not in MOVES_NOTHING
        if name in MOVES_NOTHING or name in PRICED_BY_FLOPS:
            return out
        moved, inputs = 0, set()
        schema = func._schema.arguments
        bound = list(zip(schema, args)) + [(a, kwargs[a.name]) for a in schema if a.name in kwargs]
        for arg, value in bound:
            written = arg.alias_info is not None and arg.alias_info.is_write
            passes = (1 if name in WRITE_ONLY or arg.name == "out" else 2) if written else 1
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    inputs.add(t.untyped_storage().data_ptr())
                    moved += passes * t.numel() * t.element_size()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                moved += t.numel() * t.element_size()
        self.by_op[name] = self.by_op.get(name, 0) + moved
        return out


def step_traffic(model_dir: str, *, batch: int, seq: int, dtype: str, recompute: str) -> int:
    """Bytes of memory-bound traffic of one training step (after one warm-up step) on one CPU rank."""
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(TrainConfig(model=model_dir, device="cpu", dtype=dtype, recompute=recompute))
    tokens = torch.randint(
        0, trainer.model.cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    trainer.step(tokens)
    with TrafficCounter() as counter:
        trainer.step(tokens)
    return counter.bytes


HEAD_DIM = 16
BASE = dict(hidden=64, intermediate=160, heads=4, kv_heads=2, vocab=128)
"""The tiny Llama each count starts from; each other count changes one of these."""


def traffic_coefficients(dtype: str = "bfloat16", recompute: str = "none", seq: int = 32) -> dict:
    """Bytes per token of one decoder layer, ``layer``: [per hidden, per intermediate, per query
    width (heads x head_dim), per KV width, constant]; of the model's ends (embedding, final norm,
    LM head and loss), ``ends``: [per vocabulary entry, per hidden, constant]; and of the step's
    per-parameter work (gradient accumulation and norm, AdamW on float32 masters, the 16-bit copy),
    ``per_param``. Exact: each is a difference of counted steps (layers 1 -> 2, batch 2 -> 4) over
    models that change one width at a time."""
    import transformers

    changes = [{}, {"intermediate": 320}, {"kv_heads": 4}, {"heads": 8}, {"hidden": 128}, {"vocab": 256}]
    layer_rows, layer_bytes, ends_bytes = [], [], []
    per_param = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for i, change in enumerate(changes):
            c = {**BASE, **change}
            counts = {}
            for layers in (1, 2):
                config = transformers.LlamaConfig(
                    vocab_size=c["vocab"],
                    hidden_size=c["hidden"],
                    intermediate_size=c["intermediate"],
                    num_hidden_layers=layers,
                    num_attention_heads=c["heads"],
                    num_key_value_heads=c["kv_heads"],
                    head_dim=HEAD_DIM,
                    max_position_embeddings=2 * seq,
                )
                torch.manual_seed(0)
                path = Path(tmp) / f"{i}-{layers}"
                transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
                for batch in (2, 4):
                    counts[layers, batch] = step_traffic(
                        str(path), batch=batch, seq=seq, dtype=dtype, recompute=recompute
                    )
            extra_tokens = 2 * seq
            layer = (counts[2, 4] - counts[1, 4] - counts[2, 2] + counts[1, 2]) / extra_tokens
            whole = (counts[1, 4] - counts[1, 2]) / extra_tokens  # one layer and the ends
            q, kv = c["heads"] * HEAD_DIM, c["kv_heads"] * HEAD_DIM
            widths = [c["hidden"], c["intermediate"], q, kv]
            if not change:  # the base: the per-parameter part of one layer's bytes
                h, f = c["hidden"], c["intermediate"]
                params = h * (2 * q + 2 * kv) + 3 * h * f + 2 * h
                per_param = (counts[2, 2] - counts[1, 2] - layer * 2 * seq) / params
            if "vocab" not in change:
                layer_rows.append([*widths, 1.0])
                layer_bytes.append(layer)
            ends_bytes.append((c["vocab"], c["hidden"], whole - layer))
    solved = torch.linalg.solve(
        torch.tensor(layer_rows, dtype=torch.float64), torch.tensor(layer_bytes, dtype=torch.float64)
    )
    (v0, h0, e0), (v1, _, e1), (_, h1, e2) = ends_bytes[0], ends_bytes[5], ends_bytes[4]
    per_vocab = (e1 - e0) / (v1 - v0)
    per_hidden = (e2 - e0) / (h1 - h0)
    return {
        "layer": [round(x, 3) for x in solved.tolist()],
        "ends": [round(per_vocab, 3), round(per_hidden, 3), round(e0 - per_vocab * v0 - per_hidden * h0, 3)],
        "per_param": round(per_param, 3),
    }


def routed_pair_traffic(dtype: str = "bfloat16", experts: int = 4) -> tuple[int, int]:
    """Bytes per routed (token, expert) pair and hidden unit that an MoE layer's experts block
    moves outside its matrix products, (forward, backward): the dispatch's copies of each pair's
    hidden row into expert order and back, weighted, and their gradients (``parallel/expert.py``,
    on a rank holding ``experts``). From ``experts_block_traffic`` with one and two choices a token
    at two widths: the difference is one more pair a token, and what is per token, per expert
    weight or per intermediate unit cancels."""
    tokens = 64
    c = {(h, k): experts_block_traffic(dtype, experts, h, k, tokens) for h in (64, 128) for k in (1, 2)}
    per_pair = lambda i: (c[128, 2][i] - c[128, 1][i] - c[64, 2][i] + c[64, 1][i]) / (tokens * 64)
    return round(per_pair(0)), round(per_pair(1))


def experts_block(directory: str, dtype: str, experts: int, hidden: int, width: int = 32):
    """The experts block (``ExpertParallelSwiGLU``) of a trainer's model on one rank: a random
    one-layer Qwen3-MoE with ``experts`` of ``width``, saved into ``directory``."""
    import transformers

    from shardlm.parallel.expert import ExpertParallelSwiGLU
    from shardlm.train.trainer import TrainConfig, Trainer

    config = transformers.Qwen3MoeConfig(
        vocab_size=BASE["vocab"],
        hidden_size=hidden,
        moe_intermediate_size=width,
        num_experts=experts,
        num_experts_per_tok=1,  # (callers give the choices: the router is not run)
        num_hidden_layers=1,
        num_attention_heads=BASE["heads"],
        num_key_value_heads=BASE["kv_heads"],
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    trainer = Trainer(TrainConfig(model=directory, device="cpu", dtype=dtype))
    return next(m for m in trainer.model.modules() if isinstance(m, ExpertParallelSwiGLU))


def round_robin(tokens: int, k: int, experts: int) -> torch.Tensor:
    """[tokens, k] expert choices, every expert tokens x k / experts of them."""
    return (torch.arange(tokens)[:, None] * k + torch.arange(k)) % experts


def experts_block_pass(
    dtype: str, experts: int, hidden: int, k: int, tokens: int = 64
) -> tuple[TrafficCounter, TrafficCounter]:
    """What one pass of ``experts_block`` over ``tokens`` tokens of width ``hidden``, each given
    ``k`` choices (``round_robin``), runs: its forward's and its backward's ``TrafficCounter``."""
    with tempfile.TemporaryDirectory() as tmp:
        block = experts_block(tmp, dtype, experts, hidden)
    dt = block.w13.dtype
    x = torch.randn(tokens, hidden, dtype=dt, requires_grad=True)
    with TrafficCounter() as forward:
        out = block(x, round_robin(tokens, k, experts), torch.full((tokens, k), 1 / k, dtype=dt))
    grad = torch.ones_like(out)
    with TrafficCounter() as backward:
        out.backward(grad)  # the weights' gradients made anew (a fresh model)
    return forward, backward


def experts_block_traffic(dtype: str, experts: int, hidden: int, k: int, tokens: int = 64) -> tuple[int, int]:
    """Bytes (forward, backward) of the memory-bound operators of one pass of ``experts_block``."""
    forward, backward = experts_block_pass(dtype, experts, hidden, k, tokens)
    return forward.bytes, backward.bytes

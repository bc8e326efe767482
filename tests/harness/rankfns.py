"""Functions that run on every rank of a test pool (module level, so ranks can import them)."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


def make_worker(model: str, tp: int, **options):
    """This rank's Worker for a tp-only layout over the pool's world."""
    from shardlm.engine.config import EngineConfig
    from shardlm.engine.worker import Worker

    config = EngineConfig.of(model=model, tp=tp, threads=1, **options)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    return Worker(config, rank=rank, world=world, local_rank=rank, local_world=world, init_method=None)


def worker_device(model: str, device: str) -> str:
    """The device type this rank's Worker chose for ``device`` ('auto', 'cpu' or 'cuda')."""
    return make_worker(model, 1, device=device).device.type


def greedy_completions(worker, prompts: list[list[int]], new_tokens: int, logprobs: int | None = None) -> list:
    """The worker's greedy completion of each prompt, as one batch, in the prompts' order."""
    from shardlm.engine.engine import Request
    from shardlm.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=logprobs)
    completions, _ = worker.generate([Request(p, params, 0) for p in prompts])
    return [completions[i] for i in range(len(prompts))]


def greedy_and_logits(model: str, tp: int, prompts: list[list[int]], new_tokens: int, **options):
    """(greedy tokens per prompt as one batch, logits at every position of the last prompt, param bytes)."""
    worker = make_worker(model, tp, **options)
    tokens = [c.token_ids for c in greedy_completions(worker, prompts, new_tokens)]
    logits = worker.prompt_logits(prompts[-1]).cpu()  # a CUDA tensor would not cross to the test process
    return tokens, logits, worker.model.param_bytes()


def greedy_top2(model: str, tp: int, prompts: list[list[int]], new_tokens: int, **options):
    """Greedy tokens per prompt (one batch), each with its step's two most likely tokens and their
    logprobs: [[(token, ((id, logprob), (id, logprob))), ...], ...]."""
    completions = greedy_completions(make_worker(model, tp, **options), prompts, new_tokens, logprobs=2)
    return [list(zip(c.token_ids, [lp.top for lp in c.logprobs])) for c in completions]


def cache_read_logits(model: str, tp: int, prompt: list[int], **options):
    """Logits at every position of ``prompt`` fed one token a step, so each step reads every
    earlier key and value back from the KV cache (teacher-forced decoding)."""
    return make_worker(model, tp, **options).prompt_logits(prompt, chunk=1).cpu()


def row_parallel_int8(model: str, tp: int):
    """(int8 weight, scales) of this rank's first MLP down projection with quantization="int8"."""
    from shardlm.parallel.tensor import RowParallelLinear

    worker = make_worker(model, tp, quantization="int8")
    layer = next(
        m for m in worker.model.modules() if isinstance(m, RowParallelLinear) and m.source.endswith("down_proj")
    )
    return layer.weight.detach().clone(), layer.weight_scale.detach().clone()


def shard_read_elements(model: str, tp: int) -> tuple[int, int]:
    """(elements this rank read from the checkpoint, elements of its parameters)."""
    from shardlm.models.loader import CountingSource, load_model, open_checkpoint
    from shardlm.parallel.dims import ParallelDims

    ckpt = open_checkpoint(model)
    dims = ParallelDims(tp=tp).build_mesh("cpu")
    source = CountingSource(ckpt.source())
    model = load_model(ckpt, dims, source=source)
    return source.elements, sum(p.numel() for p in model.parameters())


def llm_greedy(model: str, prompts: list[list[int]], new_tokens: int, **layout):
    """Greedy tokens per prompt through the public LLM API on this rank (SPMD over the pool)."""
    from shardlm import LLM, SamplingParams

    llm = LLM(model, threads=1, **layout)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens))
    return [o.token_ids for o in outputs], llm.param_bytes, llm.worker.layers


def llm_generate(model: str, prompts: list[list[int]], max_tokens: list[int], **layout):
    """(greedy tokens per prompt with its own max_tokens, the run's expert load) via the LLM API."""
    from shardlm import LLM, SamplingParams

    llm = LLM(model, threads=1, **layout)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens])
    return [o.token_ids for o in outputs], llm.last_stats.expert_load


def varied_runs(llm, prompts: list[list[int]], new_tokens: int, steady=contextlib.nullcontext):
    """Greedy runs of ``llm`` over batches of several sizes, contexts and per-request lengths:
    all prompts together, the last alone, then (under ``steady()``) three reordered, one, and
    three that finish early (the batch shrinks as it goes). [(prompts' indices, max_tokens,
    tokens per prompt)]."""
    from shardlm import SamplingParams

    runs = []

    def run(indices, max_tokens):
        out = llm.generate(
            [prompts[i] for i in indices], [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]
        )
        runs.append((indices, max_tokens, [o.token_ids for o in out]))

    n = len(prompts)
    run(list(range(n)), [new_tokens] * n)
    run([n - 1], [new_tokens])
    with steady():
        run([1, 2, 0], [new_tokens] * 3)
        run([0], [new_tokens])
        run([0, 1, 2], [5, 20, new_tokens])
    return runs


def compiled_runs(model: str, prompts: list[list[int]], new_tokens: int, **layout):
    """``varied_runs`` with compile=True on this rank: the first two compile the two shape classes
    (several sequences, then one); the rest run under ``fail_on_recompile``. (runs, the classes
    compiled, how many graphs dynamo traced: one per class unless something breaks the graph or
    makes dynamo trace the model again, as a Python float traced as a symbol did)."""
    import torch
    from torch._dynamo.utils import compilation_time_metrics, counters

    from shardlm import LLM

    def traces() -> int:
        retraces = sum(
            len(v)
            for k, v in compilation_time_metrics.items()
            if k.startswith("compile_attempt_") and k != "compile_attempt_0"
        )
        return counters["stats"]["unique_graphs"] + retraces

    llm = LLM(model, threads=1, compile=True, block_size=4, **layout)
    before = traces()
    runs = varied_runs(llm, prompts, new_tokens, lambda: torch.compiler.set_stance("fail_on_recompile"))
    return runs, llm.worker.runner.compiled_classes, traces() - before


def graph_runs(model: str, prompts: list[list[int]], new_tokens: int, **layout):
    """``varied_runs`` with every decode step padded to its CUDA-graph shape class: captured and
    replayed on a GPU (the default there), run eagerly from the same padded inputs on a CPU.
    (runs, the (batch, blocks) classes used, how many of them were captured as graphs)."""
    from shardlm import LLM
    from shardlm.engine.cuda_graphs import DecodeGraphs

    llm = LLM(model, threads=1, block_size=4, **layout)
    r = llm.worker.runner
    if r.device.type == "cpu":
        r.graphs = DecodeGraphs(
            r.decode_forward, device=r.device, block_size=r.block_size, scratch_block=r.scratch_block, max_batch=256
        )
    runs = varied_runs(llm, prompts, new_tokens)
    return runs, sorted(r.graphs.classes), sum(c.graph is not None for c in r.graphs.classes.values())


def train_steps(model: str, batches, dp: int, tp: int, zero: int, **options):
    """Train on ``batches`` with this layout: (each step's stats, this rank's weights as checkpoint
    pieces, the bytes of model state it held, the elements it owns of all it holds)."""
    from shardlm.train.checkpoint import pieces
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, dp=dp, tp=tp, zero=zero, threads=1, **options),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
    )
    stats = [trainer.step(b) for b in batches]
    with trainer.zero.full_weights():
        weights = pieces(trainer.model)
    units = trainer.zero.units
    return stats, weights, stats[-1]["state_bytes"], (sum(u.hi - u.lo for u in units), sum(u.numel for u in units))


def pipeline_ops(model: str, batch, **options):
    """One step with this layout: (pp rank, the (kind, micro-batch, chunk) operations it ran in
    order, the most micro-batch chunks whose activations it held at once)."""
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    trainer.step(batch)
    return trainer.dims.pp_rank, [op[:3] for op in trainer.timeline], trainer.in_flight


def train_and_save(model: str, batches, dp: int, tp: int, zero: int, directory: str, **options):
    """Train on ``batches``, then save the model as a HF directory (rank 0 writes)."""
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, dp=dp, tp=tp, zero=zero, threads=1, **options),
        rank=dist.get_rank(),
        world=dist.get_world_size(),
    )
    for b in batches:
        trainer.step(b)
    return trainer.save(directory)


def context_attention_grads(
    algorithm: str, q, k, v, grad, kv_of_q: list[int], window, tile: tuple[int, int] | None = None
):
    """This cp rank's share of attention over whole sequences (q, k, v, grad: [b, seq, heads, d]):
    (its positions, output, dq, dk, dv), each [b, local tokens, heads, d]. ``tile``: ring
    attention's (query, key) tile for this call."""
    from shardlm.models.attention import GroupedHeads
    from shardlm.parallel import context

    b, seq, _, d = q.shape
    meta = context.ContextBatch.build(dist.group.WORLD, b, seq, algorithm)
    local = [t[:, meta.positions].flatten(0, 1).clone().requires_grad_() for t in (q, k, v)]
    default = context.TILE, context.KEY_TILE
    context.TILE, context.KEY_TILE = tile or default
    try:
        o = context.context_attention(*local, meta, GroupedHeads(kv_of_q), d**-0.5, window)
        o.backward(grad[:, meta.positions].flatten(0, 1))
    finally:
        context.TILE, context.KEY_TILE = default
    n = len(meta.positions)
    return meta.positions, *(t.detach().view(b, n, -1, d) for t in (o, *(x.grad for x in local)))


def layer_activations_on_rank(model: str, tp: int, seq: int, batch: int, **options) -> int:
    """Bytes decoder layer 1 saves for backward on this rank in one bfloat16 training step."""
    import torch

    from shardlm.train.measure import layer_activations
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, tp=tp, dtype="bfloat16", threads=1, **options),
        rank=dist.get_rank() if dist.is_initialized() else 0,
        world=dist.get_world_size() if dist.is_initialized() else 1,
    )
    ids = torch.randint(0, 251, (batch, seq + 1), generator=torch.Generator().manual_seed(5))
    return layer_activations(trainer, ids, layer=1)


def train_and_save_state(model: str, batches, directory: str, **options):
    """Train on ``batches`` at this layout, save the training state: this rank's weights as
    checkpoint pieces."""
    from shardlm.train.checkpoint import pieces
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    for b in batches:
        trainer.step(b)
    trainer.save_state(directory)
    with trainer.zero.full_weights():
        return pieces(trainer.model)


def resume_and_step(model: str, batch, directory: str, **options):
    """A new Trainer at this layout loads the state and takes one step on ``batch``: (the steps
    it says were taken, its weights as pieces right after loading, the step's stats, the weights
    after it)."""
    from shardlm.train.checkpoint import pieces
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    taken = trainer.load_state(directory)
    with trainer.zero.full_weights():
        loaded = pieces(trainer.model)
    stats = trainer.step(batch)
    with trainer.zero.full_weights():
        return taken, loaded, stats, pieces(trainer.model)


def evaluate_and_step(model: str, batch, **options):
    """A new Trainer's held-out loss on ``batch``, then its training step on the same batch."""
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    return trainer.evaluate(batch), trainer.step(batch)


def expert_biases_after(model: str, batches, directory: str | None, resume: bool = False, **options):
    """The MoE layers' correction biases (DeepSeek-V3) after training on ``batches`` and saving the
    state to ``directory``; with ``resume``, those of a new run that loaded that state instead."""
    from shardlm.models.moe import moe_blocks
    from shardlm.train.trainer import TrainConfig, Trainer

    trainer = Trainer(
        TrainConfig.of(model=model, threads=1, **options), rank=dist.get_rank(), world=dist.get_world_size()
    )
    if resume:
        trainer.load_state(directory)
    else:
        for b in batches:
            trainer.step(b)
        trainer.save_state(directory)
    return [b.router.bias.clone() for b in moe_blocks(trainer.model)]

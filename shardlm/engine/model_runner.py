"""Runs one scheduled step of the model on this rank (SPMD: every rank the same step).

It owns this rank's KV cache (one ``[2, blocks, block_size, kv_heads, head_dim]`` tensor per
local layer, or ``[1, blocks, block_size, 1, latent + rope]`` for MLA: the layer's
``cache_layout``; in the model's dtype or a narrower one: ``--kv-cache-dtype``, whose int8 rows
carry their scale in 4 more bytes), flattens the step's tokens (prefills first, then decodes),
builds the attention metadata and returns the logits of each sequence's last token.

With ``compile``, decode steps run the model through ``torch.compile`` (dynamic
shapes: context length and batch size never force a recompile, except that one
sequence and several are two graphs), the way vLLM compiles its decode step; so do
steps with prompt tokens, computed as decode rows (below) while their reads stay small;
long prompts stay eager, bound by their matrix products.

With ``cuda_graphs`` (on a GPU), every step of up to the largest graph's batch of tokens
replays a CUDA graph (``cuda_graphs.py``; of the compiled forward when both are on): decodes,
and prompt tokens computed as decode rows (``prepare``'s ``rows_only``), so that a request
joining the batch does not turn the step eager. The cache holds one block more than the block
manager hands out: the scratch block a graph's padding rows write to.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable

import torch
from torch.fx.experimental import _config as fx_config

from shardlm.engine.cuda_graphs import DecodeGraphs, prompt_rows_fit
from shardlm.engine.scheduler import Batch
from shardlm.launch import busy
from shardlm.models.attention import AttentionMetadata, PrefillSeq, kv_row
from shardlm.parallel import comm
from shardlm.parallel import int4 as native
from shardlm.parallel.context_paged import ContextShards, owner

PROGRESS_EVERY_S = 30.0


class ModelRunner:
    def __init__(
        self,
        model,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        compile: bool = False,
        cuda_graphs: bool = False,
        max_num_seqs: int = 256,
        announce: bool = False,
        cp_group=None,
        cp_attention: str = "pass-q",
    ):
        self.model = model
        # context parallelism: this rank computes and caches its stripe of every sequence
        self.cp_group, self.cp, self.cp_rank = cp_group, comm.group_size(cp_group), comm.group_rank(cp_group)
        self.cp_attention = cp_attention  # how fresh prompts are attended (parallel/context_paged.py)
        self.compiled: Callable | None = None
        if compile:
            comm.prepare_compile({m.group for m in model.modules() if getattr(m, "group", None) is not None})
            # no guards on the model's modules (checking them took a sizeable share of a CPU decode
            # step: docs/performance.md): nothing
            # changes a module's attributes after loading (MoE, whose placement could, is refused
            # with compile in LLM)
            self.compiled = torch.compile(
                model.forward,
                dynamic=True,
                # on a CPU no size/stride checks on each opaque op's output in the generated wrapper
                # (hundreds a step, a sizeable share of a CPU decode step: docs/performance.md; on a
                # GPU CUDA graphs replay the step, checks and all, at no cost); our ops' fake shapes
                # are what the kernels return, as the compiled = eager tests check on CPUs and GPUs
                options={
                    "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe,
                    "size_asserts": torch.device(device).type != "cpu",
                },
            )
        # int4 weights load the C++ CPU ops (parallel/int4_cpu.cpp); decode attention takes them too
        self.cpu_ops = (
            torch.device(device).type == "cpu"
            and bool(native.NATIVE)
            and any(getattr(m, "int4", None) for m in model.modules())
        )
        self.compiled_classes: set[bool] = set()  # shape classes compiled so far: several sequences or one
        self.announce = announce  # say on stderr when a shape class compiles
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        attn = model.layers[0].attn if len(model.layers) else None
        kv_dtype = kv_dtype or dtype
        self.scratch_block = num_blocks
        shape: tuple[int, ...] = (0,)
        if attn is not None:
            planes, heads, row = attn.cache_layout()
            shape = (planes, num_blocks + 1, block_size, heads, kv_row(row, kv_dtype))
        # torch.empty only reserves address space: pages are touched as tokens arrive
        self.caches = [torch.empty(shape, dtype=kv_dtype, device=device) for _ in model.layers]
        for cache in self.caches:
            cache[:, num_blocks].view(torch.uint8).zero_()
        self.zeroed_blocks = 0  # blocks [0, zeroed_blocks) have been zeroed or written
        # prompt tokens may run as decode rows (see prepare) unless the cache is quantized: an eager
        # prompt attends to its own keys at full precision, a decode row reads them from the cache
        self.prompt_rows = kv_dtype == dtype
        self.graphs = (
            DecodeGraphs(
                self.decode_forward,
                device=device,
                block_size=block_size,
                scratch_block=num_blocks,
                max_batch=max_num_seqs,
            )
            if cuda_graphs
            else None
        )
        if compile:
            for cache in self.caches:  # fixed shapes: no symbols, nothing to coincide with a batch size
                torch._dynamo.mark_static(cache)

    @staticmethod
    def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
        if not len(model.layers):
            return 0
        planes, heads, row = model.layers[0].attn.cache_layout()
        return planes * len(model.layers) * block_size * heads * kv_row(row, dtype) * dtype.itemsize

    def _zero_new_blocks(self, highest: int) -> None:
        """Zero blocks on their first use. Batched decode pads key slots (a block's unused
        tail, and block 0 in padded tables) and masks them, but a masked slot still
        multiplies its value by a zero weight, and 0 * NaN from never-written memory is NaN.
        Blocks are handed out in increasing order first, so a high-water mark suffices."""
        if highest >= self.zeroed_blocks:
            for cache in self.caches:
                cache[:, self.zeroed_blocks : highest + 1].view(torch.uint8).zero_()  # bytes: fp8 has no fill on CPU
            self.zeroed_blocks = highest + 1

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of ``read_blocks``' output for ``num_blocks`` blocks."""
        layer = self.caches[0].view(torch.uint8).shape
        return (len(self.caches), layer[0], num_blocks, *layer[2:])

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """A copy of these blocks of every local layer, as bytes (any cache element type):
        [layers, planes, len(blocks), block_size, kv_heads, row bytes] (see ``cache_layout``)."""
        idx = torch.tensor(blocks, device=self.device)
        return torch.stack([cache.view(torch.uint8).index_select(1, idx) for cache in self.caches])

    def write_blocks(self, blocks: list[int], kv: torch.Tensor) -> None:
        """Fill these blocks from ``read_blocks``' output (another replica's, for the same layers)."""
        self._zero_new_blocks(max(blocks))  # first, or a later step would zero what lands here
        idx = torch.tensor(blocks, device=self.device)
        for cache, layer in zip(self.caches, kv):
            cache.view(torch.uint8).index_copy_(1, idx, layer)

    def prepare(
        self, batch: Batch, rows_only: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flat token ids, positions, metadata, and the rows whose logits are wanted, per sequence:
        the prompt positions it scores (prompt logprobs), then the last token of each sequence
        that reaches its end this step (a prompt chunk that does not is computed for its K/V
        only), and each of its draft tokens.

        ``rows_only``: every token, prompt tokens included, attends as a decode row does: a query
        over its sequence's blocks up to its own position (every key of the step is written
        before any is read, so this is causal attention), which lets a step with prompts replay a
        decode graph."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        bs = self.block_size
        meta = AttentionMetadata(slot_mapping=None, block_size=bs, cpu_ops=self.cpu_ops)
        dev = self.device
        decodes: list[tuple[list[int], int]] = []  # (block table, context length) of each decode row
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.counts, batch.samples())):
            start, end, table, drafts = seq.num_computed, seq.num_computed + n, seq.block_table, batch.draft(i)
            if rows_only or (n == 1 and seq.is_decoding):  # the batch lists decodes last
                decodes.extend((table, p + 1) for p in range(start, end))
            else:
                meta.prefills.append(
                    PrefillSeq(start=len(ids), length=n, context_len=end, block_table=torch.tensor(table, device=dev))
                )
            first_row = len(ids)
            ids.extend(seq.tokens(start, end - len(drafts)) + drafts)
            positions.extend(range(start, end))
            rows.extend(first_row + q - start for q in batch.prompt_rows(i))  # prompt logprobs
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            if samples:  # the last token's logits, and each draft's to verify it
                rows.extend(range(len(ids) - 1 - len(drafts), len(ids)))
        meta.num_prefill_tokens = len(ids) - len(decodes)
        if decodes:
            # compiled: at least two columns (a padding block is masked), or dynamo would specialise
            # on a one-block table and recompile when the context outgrows its first block
            max_blocks = max([len(t) for t, _ in decodes] + [2 if self.compiled is not None else 1])
            meta.decode_block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t, _ in decodes], device=dev)
            meta.decode_context_lens = torch.tensor([n for _, n in decodes], device=dev)
            meta.decode_max_context = max(n for _, n in decodes)
        self._zero_new_blocks(max(max(s.block_table) for s in batch.seqs))
        meta.slot_mapping = torch.tensor(slots, device=dev)
        return (
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            torch.tensor(rows, device=dev, dtype=torch.long),
        )

    def prepare_striped(
        self, batch: Batch, all_positions: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``prepare`` under cp: the step's tokens this cp rank owns (``context_paged.owner``), and
        metadata in which ``prefills`` lists every sequence of the step by its rows among all the
        step's tokens (the all-gathered queries); the rows whose logits are wanted are this rank's
        own (``ContextShards.gather_rows`` brings them all to every cp rank)."""
        bs, cp, dev = self.block_size, self.cp, self.device
        meta = AttentionMetadata(slot_mapping=None, block_size=bs, cpu_ops=self.cpu_ops)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        owners: list[int] = []
        wanted: list[int] = []
        local: dict[int, int] = {}  # step row -> this rank's row, for the rows it owns
        for i, (seq, n, samples) in enumerate(zip(batch.seqs, batch.counts, batch.samples())):
            start, end, table, row = seq.num_computed, seq.num_computed + n, seq.block_table, len(owners)
            meta.prefills.append(PrefillSeq(row, n, end, torch.tensor(table, device=dev)))
            for p, token in zip(range(start, end), seq.tokens(start, end)):
                owners.append(owner(p, bs, cp))
                if owners[-1] == self.cp_rank:
                    local[len(owners) - 1] = len(ids)
                    ids.append(token)
                    positions.append(p)
                    slots.append(table[p // (bs * cp)] * bs + p % bs)  # this rank's run of the group block
            wanted.extend(row + q - start for q in batch.prompt_rows(i))  # prompt logprobs
            if samples:
                wanted.append(row + n - 1)
        if all_positions:
            wanted = list(range(len(owners)))
        meta.num_prefill_tokens = len(owners)
        meta.slot_mapping = torch.tensor(slots, device=dev, dtype=torch.long)
        meta.context = ContextShards.build(self.cp_group, self.cp_rank, owners, wanted, dev, self.cp_attention)
        self._zero_new_blocks(max(max(s.block_table) for s in batch.seqs))
        rows = [local[r] for r in wanted if r in local]
        return (
            torch.tensor(ids, device=dev, dtype=torch.long),
            torch.tensor(positions, device=dev, dtype=torch.long),
            meta,
            torch.tensor(rows, device=dev, dtype=torch.long),
        )

    def step_tokens(self, batch: Batch) -> int:
        """Tokens of the step this rank computes (its own under cp, else all)."""
        if self.cp == 1:
            return batch.num_tokens()
        return sum(
            owner(p, self.block_size, self.cp) == self.cp_rank
            for s, n in zip(batch.seqs, batch.counts)
            for p in range(s.num_computed, s.num_computed + n)
        )

    @torch.inference_mode()
    def run(self, batch: Batch, hidden: torch.Tensor | None = None, all_positions: bool = False):
        """This stage's part of one step. The first stage starts from token ids, the others
        from the previous stage's ``hidden`` ([2 (hidden, residual), tokens, dim]).

        Returns float32 logits [rows, vocab] on the last stage: one row per sequence that
        samples, 1 + its drafts with speculative decoding (with ``all_positions``: [tokens,
        vocab]), else (hidden, residual).

        With graphs, a step of at most their largest batch of tokens replays one, prompts
        and all (``prepare``'s ``rows_only``); with compile, a step with prompt tokens runs
        compiled the same way. Prompt chunks deep into long contexts
        (``cuda_graphs.prompt_rows_fit``) and, with graphs, longer steps run eagerly.
        """
        if self.cp > 1:  # the config refuses graphs, compile and drafts with cp
            ids, positions, meta, rows = self.prepare_striped(batch, all_positions)
            out = self.model(ids if hidden is None else hidden, positions, meta, self.caches, rows)
            return out.float() if self.model.last else out
        rows_only = graph = False
        scores = any(batch.prompt_rows(i) for i in range(len(batch.seqs)))  # prompt logprobs: eager
        if (self.graphs is not None or self.compiled is not None) and not all_positions and not scores:
            tokens = sum(batch.counts)
            as_rows = all(n == 1 and s.is_decoding for s, n in zip(batch.seqs, batch.counts)) or (
                self.prompt_rows
                and prompt_rows_fit(tokens, max(len(s.block_table) for s in batch.seqs), self.block_size)
            )
            graph = as_rows and self.graphs is not None and self.graphs.fits(tokens)
            rows_only = graph or (as_rows and self.compiled is not None)
        ids, positions, meta, last_rows = self.prepare(batch, rows_only=rows_only)
        args = (ids if hidden is None else hidden, positions, meta, self.caches, None if all_positions else last_rows)
        if graph:
            assert self.graphs is not None and last_rows is not None  # graphs run decode rows only
            out = self.graphs.run(args[0], positions, meta, self.caches, last_rows)
        elif not meta.prefills and not all_positions:
            out = self.decode_forward(*args)
        else:
            out = self.model(*args)
        return out.float() if self.model.last else out

    def decode_forward(self, *args):
        if self.compiled is None:
            return self.model(*args)
        return self._run_compiled(args, several=len(args[1]) > 1)

    def _run_compiled(self, args, several: bool):
        # Without duck sizing: by default dynamo assumes two sizes that happen to be equal when it
        # traces (say 4 sequences and 4-token blocks, or as many sequences as table columns) stay
        # equal, and recompiles the first time they differ. Python floats (the attention scale,
        # norm epsilons) are the model's constants: traced as symbols, inductor's pass that turns
        # them into tensors gives up and dynamo traces the whole model again (~30 s here).
        assert self.compiled is not None
        # torch's config modules gain patch() when they are installed, which mypy cannot see
        with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):  # type: ignore[attr-defined]
            if several in self.compiled_classes:
                return self.compiled(*args)
            return self._compile_class(args, several)

    def _compile_class(self, args, several: bool):
        assert self.compiled is not None
        with announced(f"the decode step for {'several sequences' if several else 'one sequence'}", self.announce):
            out = self.compiled(*args)
        self.compiled_classes.add(several)
        return out


@contextlib.contextmanager
def announced(what: str, enabled: bool):
    """While ``what`` compiles (minutes on a small CPU), tell the driver every
    PROGRESS_EVERY_S that this rank is busy, not hung (``launch.busy``); if ``enabled``, also
    say on stderr that it compiles, that it still does, and when it is done."""
    start = time.perf_counter()
    done = threading.Event()

    def say(text: str) -> None:
        if enabled:
            print(f"shardlm: {text}", file=sys.stderr, flush=True)

    def progress() -> None:
        while not done.wait(PROGRESS_EVERY_S):
            busy(f"compiling {what}")
            say(f"still compiling {what} ({time.perf_counter() - start:.0f} s)")

    say(f"compiling {what} (once; cached on disk for later runs)")
    threading.Thread(target=progress, daemon=True).start()
    try:
        yield
    finally:
        done.set()
    say(f"compiled {what} in {time.perf_counter() - start:.0f} s")

"""CUDA graphs of decode steps (vLLM captures its decode steps the same way; CUDA Programming
Guide, "CUDA Graphs").

A decode step of a small model on a GPU is bound by launching its kernels from Python, ~30 a
layer, not by the GPU (a step of SmolLM2 on an H100 cost the same at 8 and at 32 sequences;
docs/performance.md, "On a GPU"). A graph records the step's kernels once and replays them with one launch.

A graph fixes every shape and address, so a step is padded to a *shape class*: the batch to
the next of 1, 2, 4, 8, 16, 24, 32, ... sequences (vLLM's capture sizes) and the block tables
to the next power of two of blocks (at least 2); keys past each sequence's context are masked,
as in any batched decode (``AttentionMetadata.decode_padded``). Each class is captured on its
first step, into its own static inputs that later steps copy into, and all classes share one
memory pool. A padding row is position 0 of an empty sequence whose one block is the runner's
scratch block, which no sequence owns: its key and value land there, never in a real block.

A step's rows are its tokens: decodes, and the tokens of short prompts (or prompt chunks)
computed as decode rows of their own (``ModelRunner.prepare``): in serving, a request joins the
batch every few steps, and each such step would otherwise run eagerly, several times slower.
Steps of more tokens than the largest class (``max_batch``), or whose prompt rows would read
too much (``prompt_rows_fit``), run eagerly.

On a CPU (no graphs) the same padded inputs run eagerly: how the test suite checks the padding
on hosts without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardlm.models.attention import AttentionMetadata

PROMPT_ROW_KEYS = 1 << 18
"""Most key slots (rows x padded context) a step with prompt tokens may read as decode rows: each
row reads its sequence's whole table, so a prompt chunk late in a long context would read it
once per token (256 tokens at 8192 of context read 2M key slots a layer). Beyond this the step runs eagerly; decode-only steps read each context once anyway."""


def prompt_rows_fit(tokens: int, blocks: int, block_size: int) -> bool:
    """Whether a step of ``tokens`` with prompt tokens, whose widest table has ``blocks`` blocks,
    may run as decode rows: its padded rows x context within ``PROMPT_ROW_KEYS``."""
    return batch_class(tokens) * blocks_class(blocks) * block_size <= PROMPT_ROW_KEYS


def batch_class(n: int) -> int:
    """Sequences a decode step of ``n`` is padded to."""
    return next((b for b in (1, 2, 4, 8) if n <= b), -(-n // 8) * 8)


def blocks_class(n: int) -> int:
    """Block-table columns a step whose widest table has ``n`` blocks is padded to."""
    return max(2, 1 << (n - 1).bit_length())


@dataclass
class _Class:
    """One shape class: its static inputs, the metadata pointing at them, and its graph."""

    first: torch.Tensor  # [batch] token ids, or [2, batch, hidden] on a later pipeline stage
    positions: torch.Tensor  # [batch]
    rows: torch.Tensor  # [batch] rows whose logits are wanted
    meta: AttentionMetadata
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Runs steps whose every token is a decode row through ``forward(first, positions, meta,
    caches, rows)``, padded to their shape class, from a CUDA graph on a GPU."""

    def __init__(self, forward, *, device: torch.device, block_size: int, scratch_block: int, max_batch: int):
        self.forward = forward
        self.device = device
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_batch = batch_class(max_batch)
        self.classes: dict[tuple[int, int], _Class] = {}  # (batch, blocks) -> its inputs and graph
        # every graph copies its output here: [max_batch, vocab] logits, or [2, max_batch, hidden]
        # (one buffer for all classes, where outputs of their own would add up over a server's life)
        self.out: torch.Tensor | None = None

    def fits(self, tokens: int) -> bool:
        """Whether a step of this many decode rows has a shape class."""
        return batch_class(tokens) <= self.max_batch

    def run(
        self,
        first: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[torch.Tensor],
        rows: torch.Tensor,
    ):
        """The forward's output for this step (the real rows and tokens only)."""
        n = len(positions)
        assert meta.decode_block_tables is not None  # every row of a graph step is a decode row
        key = (batch_class(n), blocks_class(meta.decode_block_tables.shape[1]))
        c = self.classes.get(key)
        if c is None:
            c = self.classes[key] = self._new_class(*key, first)
        self._fill(c, n, first, positions, meta, rows)
        args = (c.first, c.positions, c.meta, caches, c.rows)
        if not self.capture:
            return _real(self.forward(*args), n, len(rows))
        if c.graph is None:
            c.graph = self._capture(c, args)
        c.graph.replay()
        out = _real(self.out, n, len(rows))  # copied: the next replay overwrites the buffer
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def _new_class(self, batch: int, blocks: int, first: torch.Tensor) -> _Class:
        dev = self.device
        shape = (batch,) if first.dim() == 1 else (first.shape[0], batch, *first.shape[2:])
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.long, device=dev),
            block_size=self.block_size,
            decode_block_tables=torch.zeros(batch, blocks, dtype=torch.long, device=dev),
            decode_context_lens=torch.ones(batch, dtype=torch.long, device=dev),
            decode_max_context=blocks * self.block_size,
            decode_padded=True,
        )
        return _Class(
            first=first.new_zeros(shape),
            positions=torch.zeros(batch, dtype=torch.long, device=dev),
            rows=torch.zeros(batch, dtype=torch.long, device=dev),
            meta=meta,
        )

    def _fill(self, c: _Class, n: int, first, positions, meta: AttentionMetadata, rows) -> None:
        """Copy the step into the class's inputs; the rows past ``n`` become padding."""
        tables, slots, lens = c.meta.decode_block_tables, c.meta.slot_mapping, c.meta.decode_context_lens
        new_tables, new_slots, new_lens = meta.decode_block_tables, meta.slot_mapping, meta.decode_context_lens
        assert tables is not None and slots is not None and lens is not None  # built by _new_class
        assert new_tables is not None and new_slots is not None and new_lens is not None  # a decode step's
        width, batch = new_tables.shape[1], len(c.positions)
        c.first.narrow(0 if c.first.dim() == 1 else 1, 0, n).copy_(first)  # ids, or hidden states
        c.positions[:n].copy_(positions)
        c.rows[: len(rows)].copy_(rows)  # the rest keep old rows (< batch), whose logits are dropped
        tables[:n, :width].copy_(new_tables)
        tables[:n, width:].zero_()  # masked columns: any block with finite contents will do
        slots[:n].copy_(new_slots)
        lens[:n].copy_(new_lens)
        if n < batch:
            c.positions[n:].zero_()
            tables[n:].zero_()
            tables[n:, 0] = self.scratch_block
            slots[n:] = self.scratch_block * self.block_size
            lens[n:] = 1

    def _capture(self, c: _Class, args) -> torch.cuda.CUDAGraph:
        """The class's graph, captured (set on the class only once captured: a failed capture leaves
        the class to try again)."""
        # one eager run first, on a side stream as torch's docs do it: lazy initialisations
        # (cuBLAS handles, workspaces) must happen before capture, not inside it; the step's own
        # keys and values are written again, alike, by the replay that follows
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        if self.out is None:
            pair = isinstance(warm, tuple)
            head = warm[0] if pair else warm
            shape = (2, self.max_batch, head.shape[-1]) if pair else (self.max_batch, head.shape[-1])
            self.out = head.new_empty(shape)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of this process (NCCL's watchdog, the serve loop's) may
        # call CUDA meanwhile; only this thread's calls belong to the capture
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.forward(*args)
            if isinstance(out, tuple):
                self.out[0, : len(out[0])].copy_(out[0])
                self.out[1, : len(out[1])].copy_(out[1])
            else:
                self.out[: len(out)].copy_(out)
        return graph


def _real(out, n: int, rows: int):
    """The real part of a step's output: (hidden, residual) [n, hidden] each, or logits [rows, vocab]."""
    if isinstance(out, tuple) or out.dim() == 3:
        return out[0][:n], out[1][:n]
    return out[:rows]

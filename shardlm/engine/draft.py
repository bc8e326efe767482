"""Draft-model speculative decoding: a small model drafts k tokens for every decoding sequence.

The draft is a model with the target's vocabulary: another checkpoint (vLLM's
``{"model": PATH, "num_speculative_tokens": k}``, method 'draft_model'), or the target's own
first n decoder layers followed by its final norm and LM head (method 'layer_skip', a
self-draft as in Elhoushi et al. 2024, LayerSkip, https://arxiv.org/abs/2404.16710, without
its early-exit training; at pp=1 it shares the target's weights, no copy).

Where it runs: on the sampling ranks (the last pipeline stage), sharded over their tp group
like the target, so its logits are gathered whole on every tp rank and every rank drafts the
same tokens (greedy: argmax; sampling: a draw from q = the draft's distribution under the
request's temperature, top-k and top-p, with a generator of its own seeded from the
request's). Right after a step is verified, the drafter drafts every sequence that goes on
for its next step; the drafts travel to the other stages with the step's tokens (engine.py),
and the scheduler feeds up to k of them in that next step, verified in one target forward
(speculative.py: greedy exact, sampling by rejection with q).

Its KV cache is paged like the target's and indexed by the same block ids (one block of the
draft's cache per block of the target's), so the block manager's blocks serve both; the
draft's cache also has a few scratch blocks per sequence for the positions of its own
drafts, beyond the blocks the sequence holds. Consistency after rejections: each sequence
records how many of its tokens the draft's cache holds (``Sequence.draft_computed``); a
drafting round first feeds the draft the tokens it lacks (the whole prompt the first time,
then the last step's accepted drafts and the target's token), which overwrites whatever the
rejected drafts left in those slots, then drafts from there. Only positions the target has
computed too count as held, so nothing a rejected draft wrote is ever read as history; a
preempted sequence starts over (the scheduler resets it with its blocks).
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import nn

from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.sampling import probabilities
from shardlm.engine.sequence import Sequence
from shardlm.engine.speculative import SpeculativeConfig
from shardlm.errors import UsageError
from shardlm.models.attention import AttentionMetadata, PrefillSeq
from shardlm.models.loader import Checkpoint, load_model, open_checkpoint
from shardlm.parallel.dims import LayoutError
from shardlm.parallel.tensor import partition_heads, quantize_int8


class Drafter:
    """The draft model, its paged KV cache, and one drafting round over a step's sequences."""

    def __init__(
        self,
        model,
        *,
        k: int,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        max_num_seqs: int,
    ):
        self.k = k
        # a sequence's drafts reach at most k positions past the blocks it holds: scratch blocks for them,
        # after the target's (block b of the target's is the draft's b), zeroed as first used (``_forward``)
        self.scratch = -(-k // block_size) + 1
        self.first_scratch = num_blocks
        self.scratch_zeroed = 0
        self.runner = ModelRunner(
            model,
            num_blocks=num_blocks + max_num_seqs * self.scratch,
            block_size=block_size,
            device=device,
            dtype=dtype,
            kv_dtype=kv_dtype,
            max_num_seqs=max_num_seqs,
        )

    @torch.inference_mode()
    def propose(self, work: list[tuple[Sequence, list[int], int]]) -> None:
        """Draft for each (sequence, its tokens after this step, most drafts it can use): sets its
        ``proposed`` drafts, their distributions ``draft_q`` (None when greedy) and ``draft_computed``.
        One batched forward feeds each sequence the tokens the draft's cache lacks and drafts the
        first token from the last one's logits; then k - 1 batched one-token forwards draft the rest."""
        if not work:
            return
        tables = []
        for i, (seq, _, _) in enumerate(work):
            scratch = range(self.first_scratch + i * self.scratch, self.first_scratch + (i + 1) * self.scratch)
            tables.append(seq.block_table + list(scratch))
        self._zero_blocks(work)
        # catch up: positions [draft_computed, len(tokens)); those of several tokens first (prefills)
        feeds = [(i, seq.draft_computed, tokens[seq.draft_computed :]) for i, (seq, tokens, _) in enumerate(work)]
        feeds.sort(key=lambda f: len(f[2]) == 1)
        logits = self._forward([(tables[i], start, ids) for i, start, ids in feeds])
        order = [i for i, _, _ in feeds]
        drafts: list[list[int]] = [[] for _ in work]
        qs: list[list[torch.Tensor]] = [[] for _ in work]
        for row, i in enumerate(order):
            self._draw(work[i][0], logits[row], drafts[i], qs[i])
        for j in range(1, max(limit for _, _, limit in work)):  # feed draft j, draw draft j + 1
            active = [i for i, (_, _, limit) in enumerate(work) if limit > j]
            logits = self._forward([(tables[i], len(work[i][1]) - 1 + j, [drafts[i][-1]]) for i in active])
            for row, i in enumerate(active):
                self._draw(work[i][0], logits[row], drafts[i], qs[i])
        for i, (seq, tokens, _) in enumerate(work):
            seq.proposed = drafts[i]
            seq.draft_q = torch.stack(qs[i]) if qs[i] else None
            # the last token's slot may be a scratch one (its block is grown at the next step): fed again then
            seq.draft_computed = len(tokens) - 1

    def _draw(self, seq: Sequence, logits: torch.Tensor, drafts: list[int], qs: list[torch.Tensor]) -> None:
        """The next draft from the draft's logits [vocab]: argmax (greedy), else a draw from q."""
        if seq.params.greedy:
            drafts.append(int(logits.argmax()))
            return
        if seq.draft_generator is None:  # its own stream: the target's decides acceptance
            seed = seq.generator.initial_seed() if seq.generator is not None else seq.id
            seq.draft_generator = torch.Generator(device="cpu").manual_seed(seed ^ 0x5EED)
        q = probabilities(logits, seq.params)
        qs.append(q)
        drafts.append(int(torch.multinomial(q, 1, generator=seq.draft_generator).item()))

    def _zero_blocks(self, work) -> None:
        """Zero the blocks this round may read before their first write (never-written memory may hold
        NaN, which a masked slot's zero weight would spread: ``ModelRunner._zero_new_blocks``)."""
        self.runner._zero_new_blocks(max(max(seq.block_table) for seq, _, _ in work))
        if (n := len(work) * self.scratch) > self.scratch_zeroed:
            for cache in self.runner.caches:
                cache[:, self.first_scratch + self.scratch_zeroed : self.first_scratch + n].view(torch.uint8).zero_()
            self.scratch_zeroed = n

    def _forward(self, feeds: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
        """Float32 logits [len(feeds), vocab] at the last token of each (block table, first position,
        tokens); feeds of several tokens come first (prefill rows), then single tokens (decode rows)."""
        bs, dev = self.runner.block_size, self.runner.device
        meta = AttentionMetadata(slot_mapping=None, block_size=bs, cpu_ops=self.runner.cpu_ops)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        decodes: list[tuple[list[int], int]] = []
        for table, start, tokens in feeds:
            end = start + len(tokens)
            if len(tokens) > 1:
                meta.prefills.append(PrefillSeq(len(ids), len(tokens), end, torch.tensor(table, device=dev)))
            else:
                decodes.append((table, end))
            ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            rows.append(len(ids) - 1)
        meta.num_prefill_tokens = len(ids) - len(decodes)
        if decodes:
            width = max(len(t) for t, _ in decodes)
            meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in decodes], device=dev)
            meta.decode_context_lens = torch.tensor([n for _, n in decodes], device=dev)
            meta.decode_max_context = max(n for _, n in decodes)
        meta.slot_mapping = torch.tensor(slots, device=dev)
        out = self.runner.model(
            torch.tensor(ids, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            self.runner.caches,
            torch.tensor(rows, device=dev, dtype=torch.long),
        )
        return out.float().cpu()


def first_layers(model, n: int):
    """The target model's first ``n`` decoder layers with its final norm and LM head, sharing its
    weights (a one-stage model: it holds the embedding, every layer and the head)."""
    draft = copy.copy(model)  # shallow: the same modules and parameters
    draft._modules = dict(model._modules)
    draft._modules["layers"] = nn.ModuleList(list(model.layers[:n]))
    draft.cfg = dataclasses.replace(model.cfg, num_layers=n)
    draft.chunks = (range(n),)
    return draft


def load_draft(spec: SpeculativeConfig, target, ckpt: Checkpoint, dims, quantization: str | None, **load):
    """This sampling rank's draft model (``load``: load_model's dtype, device, max_positions). Layer
    skip: the target's first layers, shared at pp=1 (quantized as the target is), else read again
    from its checkpoint and quantized the same way. A draft checkpoint loads in float (``dtype``)."""
    if spec.method == "layer_skip":
        assert spec.num_layers is not None  # SpeculativeConfig checked it
        if target.first and target.last and len(target.chunks) == 1:
            return first_layers(target, spec.num_layers)
        truncated = dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, num_layers=spec.num_layers))
        int4 = quantization if quantization in ("int4", "gguf") else None
        model = load_model(truncated, dims, int4=int4, **load)
        if quantization == "int8":
            quantize_int8(model)
        return model
    assert spec.model is not None
    return load_model(open_checkpoint(spec.model), dims, **load)


def check_draft(config: SpeculativeConfig | dict | None, ckpt: Checkpoint, tp: int, max_len: int) -> None:
    """Refuse a draft that cannot draft for this target at this layout, before any rank starts."""
    spec = SpeculativeConfig.of(config)
    if spec is None or not spec.drafts_with_model:
        return
    target = ckpt.config
    if spec.method == "layer_skip":
        if spec.num_layers is not None and spec.num_layers >= target.num_layers:
            raise UsageError(
                f"speculative num_layers={spec.num_layers} must be below the target's {target.num_layers} layers "
                f"(the draft is its first layers); use e.g. {max(1, target.num_layers // 4)}"
            )
        if target.is_moe:
            raise UsageError(
                "speculative method='layer_skip' drafts with the target's layers, and this target's experts "
                "would exchange tokens in the draft's steps, which only the sampling ranks run; use a dense "
                "draft model (method='draft_model') or ngram"
            )
        return
    draft = open_checkpoint(str(spec.model)).config
    if draft.vocab_size != target.vocab_size:
        raise UsageError(
            f"speculative model={spec.model!r} has a vocabulary of {draft.vocab_size} tokens and the target "
            f"{target.vocab_size}; a draft must share the target's tokenizer: give one of its family"
        )
    if draft.is_moe:
        raise UsageError(
            f"speculative model={spec.model!r} is a mixture of experts; drafts run on the sampling ranks only, "
            "where expert all-to-alls cannot: give a dense draft model"
        )
    draft.check_supported()
    if draft.max_position_embeddings < max_len:
        raise UsageError(
            f"speculative model={spec.model!r} takes {draft.max_position_embeddings} positions and sequences "
            f"here reach {max_len}; lower max_model_len to {draft.max_position_embeddings} or use a longer draft"
        )
    try:
        partition_heads(draft.num_heads, draft.num_kv_heads, tp, 0)
    except LayoutError as e:
        raise UsageError(f"speculative model={spec.model!r} is sharded like the target over tp={tp}: {e}") from None

"""The generation loop of one replica: schedule, run the model, sample, repeat.

Every rank of the replica runs this same loop on the same requests (SPMD). The
schedulers are deterministic and every rank learns every sampled token, so the ranks
agree on every step without exchanging a plan. Requests may arrive between rounds
(``add``), which is how the server feeds it; ``run`` is the offline loop.

Pipeline stages keep ``micro_batches`` independent batches in flight (vLLM's
"virtual engines"): requests are split between micro-batches, each with its own
scheduler, visited round-robin. A stage runs micro-batch j's step, sends the hidden
states on and moves to micro-batch j+1 while the next stage works on j. Micro-batch
j's next step waits only for j's own tokens, which come back from the last stage
(see ``StageLinks``). With one stage this is the plain loop with one micro-batch.

DP attention (MoE): when expert layers exchange tokens across replicas (all-to-all over
ranks of several replicas), the replicas step in lockstep: before each micro-batch step
the ranks agree over their dp group whether any replica runs it, and a replica with
nothing to run joins the expert collectives with an empty batch (``idle_forward``), so
collectives never mismatch. Otherwise replicas never wait for each other.

Disaggregated serving (disagg.py): a request added with a ``handoff`` replica leaves this
engine once its prompt is computed and its first token sampled; its KV cache goes to that
replica's engine, which ``adopt``s it and decodes the rest.

Speculative decoding with a draft model (draft.py): the last stage drafts each sequence's next
drafts right after it verifies a step, and the step's token message carries them (k slots a
sequence) to the other stages, whose schedulers then feed them in that sequence's next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.disagg import Handoff, adopt, hand_off
from shardlm.engine.draft import Drafter
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.sampling import SamplingParams, TokenLogprob, logprobs_of, process, processes, sample
from shardlm.engine.scheduler import Batch, Scheduler, SchedulerConfig
from shardlm.engine.sequence import Sequence, Status
from shardlm.engine.speculative import verify
from shardlm.engine.structured import Guide
from shardlm.engine.text import StopText
from shardlm.errors import UsageError
from shardlm.models.moe import idle_forward
from shardlm.models.tokenizer import Tokenizer
from shardlm.parallel import comm
from shardlm.parallel.data import ReplicaLink
from shardlm.parallel.pipeline import StageLinks


@dataclass(frozen=True)
class Request:
    """One prompt, already tokenized, with its sampling parameters and seed."""

    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    handoff: int | None = None  # disaggregated serving: prefill here, then decode on this dp rank
    after: int | None = None  # n > 1: the request id of a sibling with the same prompt, computed first


@dataclass
class RunStats:
    """Timing of one ``Engine.run`` (seconds from its start)."""

    elapsed_s: float = 0.0
    first_token_s: float | None = None  # until the first sampled token of the run
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_s: float = 0.0  # from the first sampled token to the end
    decode_tokens: int = 0  # tokens generated after each sequence's first
    busy_s: float = 0.0  # this rank computing (model and sampling), not waiting on other stages
    draft_tokens: int = 0  # speculative decoding: draft tokens verified
    accepted_tokens: int = 0  # of those, accepted
    expert_load: dict | None = None  # MoE: tokens per expert and per ep rank, imbalance (ExpertLoad)

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None


TokenCallback = Callable[[int, int, TokenLogprob | None], None]  # (request id, token id, its logprobs)
StepTokens = list[int | list[int] | None]
"""A step's tokens per sequence: one token, a verified run (with drafts), or None (no sample)."""
StepLogprobs = list[list[TokenLogprob] | None]
"""A step's logprobs per sequence, one entry per emitted token (None: not asked for, or no sample)."""
Sampled = tuple[StepTokens, StepLogprobs, StepLogprobs]
"""A step's tokens, their logprobs, and the logprobs of the prompt tokens it scored."""


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        *,
        eos_ids: tuple[int, ...],
        config: SchedulerConfig,
        links: StageLinks,
        micro_batches: int = 1,
        lockstep=None,
        replica_link: ReplicaLink | None = None,
        tokenizer: Tokenizer | Callable[[], Tokenizer] | None = None,
        draft_slots: int = 0,
        drafter: Drafter | None = None,
    ):
        self.runner = runner
        self.draft_slots = draft_slots  # a draft model's k: drafts each sampled sequence's message carries
        self.drafter = drafter  # on the last stage, with draft_slots: drafts the next steps
        self.lockstep = lockstep  # the dp group when replicas share expert collectives
        self.blocks = blocks
        self.links = links
        self.eos_ids = eos_ids
        self._tokenizer = tokenizer  # loaded by the first request with stop strings
        self.scheds = [Scheduler(blocks, config) for _ in range(micro_batches)]
        self.pending: list[tuple[Batch, Sampled | None] | None] = [None] * micro_batches
        self.seqs: dict[int, Sequence] = {}  # unfinished, by request id
        self.prompt_logprobs_out: list[
            tuple[int, list[TokenLogprob]]
        ] = []  # scored since the serve loop last took them
        self.parked: dict[int, list[Sequence]] = {}  # siblings waiting for a request's prompt, by its id
        self.aborted: set[int] = set()
        self.busy_s = 0.0
        self.replica_link = replica_link  # disaggregated serving: KV to or from other replicas
        self.handoffs: list[Handoff] = []  # sent since the serving loop last took them
        self.recomputed_handoffs = 0  # adopted without a free block: queued to be recomputed

    # ---- requests in, between rounds ---------------------------------------------------
    def add(self, rid: int, request: Request) -> Sequence:
        """Queue a request on the micro-batch with the least outstanding work (the same on every rank).

        A request ``after`` a sibling whose prompt is not computed yet waits (parked) until it is, then
        joins the sibling's micro-batch and finds the prompt's full blocks in the prefix cache: n
        choices of one prompt compute it once (vLLM's parallel sampling)."""
        p = request.params
        gen = None if p.greedy else torch.Generator(device="cpu").manual_seed(request.seed)
        seq = self.sequence(rid, request.prompt_ids, p, generator=gen, handoff=request.handoff)
        first = self.seqs.get(request.after) if request.after is not None else None
        if first is not None and not first.output_ids and first.status is not Status.FINISHED:
            self.parked.setdefault(first.id, []).append(seq)
        else:
            self.least_loaded().add(seq)
        self.seqs[rid] = seq
        return seq

    def sequence(
        self,
        rid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        generator: torch.Generator | None,
        handoff: int | None = None,
        output_ids: list[int] | None = None,
    ) -> Sequence:
        """A request's sequence (``output_ids``: the tokens another replica already generated)."""
        stop_text = StopText(self.tokenizer(), params.stop) if params.stop else None
        seq = Sequence(
            rid, prompt_ids, params, eos_ids=self.eos_ids, generator=generator, handoff=handoff, stop_text=stop_text
        )
        if output_ids:
            seq.output_ids = list(output_ids)
            if stop_text is not None:
                stop_text.push(seq.output_ids)
        return seq

    def least_loaded(self) -> Scheduler:
        """The micro-batch with the fewest tokens still to process."""
        work = [
            sum(s.num_tokens + s.params.max_tokens - len(s.output_ids) for s in (*sc.waiting, *sc.running))
            for sc in self.scheds
        ]
        return self.scheds[work.index(min(work))]

    def _unpark(self, sched: Scheduler, seqs: list[Sequence]) -> list[Sequence]:
        """Queue the siblings parked on these sequences once their prompt is computed (or they ended);
        returns the siblings aborted while parked."""
        gone = []
        for seq in seqs:
            if seq.id in self.parked and (seq.output_ids or seq.status is Status.FINISHED):
                for sibling in self.parked.pop(seq.id):
                    if sibling.id in self.aborted:
                        sibling.finish("abort")
                        gone.append(sibling)
                    else:
                        sched.add(sibling)
        return gone

    def adopt(self, handoff: Handoff) -> None:
        """Continue a sequence another replica prefilled (disaggregated serving)."""
        adopt(self, handoff)

    def abort(self, rid: int) -> None:
        """Drop a request; applied when its micro-batch has no step in flight."""
        if rid in self.seqs:
            self.aborted.add(rid)

    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise UsageError("stop strings and structured outputs need the model's tokenizer; this engine has none")
        if not isinstance(self._tokenizer, Tokenizer):
            self._tokenizer = self._tokenizer()  # once
        return self._tokenizer

    def has_work(self) -> bool:
        return any(self.pending) or any(s.has_work() for s in self.scheds)

    def any_replica(self, flag: bool) -> bool:
        """``flag`` on this replica or (in lockstep) any replica: one MAX all-reduce over dp."""
        if self.lockstep is None:
            return flag
        t = torch.tensor([int(flag)], device=self.runner.device)
        return bool(comm.all_reduce(t, self.lockstep, op="max").item())

    # ---- one round: a step of every micro-batch that has work ---------------------------
    def step_round(self, on_token: TokenCallback | None = None) -> list[Sequence]:
        """Returns the sequences that finished (or were aborted) this round."""
        done: list[Sequence] = []
        stepped = False
        for j, sched in enumerate(self.scheds):
            if (pending := self.pending[j]) is not None:  # this micro-batch's previous step: learn its tokens
                done += self._finish_step(sched, *pending, on_token)
                self.pending[j] = None
            for seq in [s for s in (*sched.waiting, *sched.running) if s.id in self.aborted]:
                sched.abort(seq)
                done.append(seq)
            done += self._unpark(sched, [s for s in done if s.id in self.parked])
            batch = sched.schedule() if sched.has_work() else None
            runs = batch is not None and bool(batch.seqs)  # empty: waits for blocks another micro-batch holds
            if self.any_replica(runs):
                if batch is not None and runs:
                    tokens = self._step(batch)
                    stepped = True
                    if self.links.first and self.links.last:  # one stage: the tokens are here, out with them now
                        done += self._finish_step(sched, batch, tokens, on_token)
                    else:
                        self.pending[j] = (batch, tokens)
                else:
                    idle_forward(self.runner.model)  # join the other replicas' expert collectives
        for seq in done:
            self.seqs.pop(seq.id, None)
            self.aborted.discard(seq.id)
        if not stepped and not any(self.pending) and any(s.has_work() for s in self.scheds):
            raise RuntimeError("no micro-batch found a sequence that can run")  # add() admits only what fits
        return done

    def _finish_step(self, sched: Scheduler, batch: Batch, sampled: Sampled | None, on_token) -> list[Sequence]:
        if sampled is None:  # sampled by the last stage
            size = sum(_message_slots(batch, self.draft_slots))
            flat = self.links.recv_tokens(size, self.runner.device) if size else []
            sampled = _unpack(batch, flat, self.draft_slots)
        before = [len(s.output_ids) for s in batch.seqs]
        done = sched.update(batch, *sampled)
        for seq, entries in zip(batch.seqs, sampled[2]):
            if entries:  # for the serving loop to send on
                self.prompt_logprobs_out.append((seq.id, entries))
        done += self._unpark(sched, batch.seqs)
        if on_token is not None:  # the tokens each sequence kept (a stop ends a verified run early)
            for seq, n in zip(batch.seqs, before):
                for at in range(n, len(seq.output_ids)):
                    on_token(seq.id, seq.output_ids[at], seq.logprobs[at] if seq.params.logprobs is not None else None)
        for seq in batch.seqs:  # prefilled for a decode replica: its KV goes there, it leaves here
            prefilled = seq.status is Status.RUNNING and seq.output_ids and seq.id not in self.aborted
            if seq.handoff is not None and prefilled:
                self.handoffs.append(hand_off(self, sched, seq))
                del self.seqs[seq.id]
        return done

    def _step(self, batch: Batch) -> Sampled | None:
        """Run this stage's part of one step; the last stage samples (and sends) the tokens."""
        hidden = None
        if not self.links.first:
            shape = (2, self.runner.step_tokens(batch), self.runner.model.cfg.hidden_size)
            hidden = self.links.recv_hidden(shape, self.runner.dtype, self.runner.device)
        t0 = time.perf_counter()
        out = self.runner.run(batch, hidden)
        if not self.links.last:
            hidden = torch.stack(out)  # [2 (hidden, residual), tokens, hidden]
            self.busy_s += time.perf_counter() - t0
            self.links.send_hidden(hidden)
            return None
        sampled = _sample(batch, out.cpu(), self.tokenizer)
        if self.drafter is not None:
            self._draft(batch, sampled[0])
        self.busy_s += time.perf_counter() - t0
        if any(_message_slots(batch, self.draft_slots)):  # the size every other stage expects (_finish_step)
            self.links.send_tokens(_pack(batch, sampled, self.draft_slots), self.runner.device)
        return sampled

    def _draft(self, batch: Batch, tokens: StepTokens) -> None:
        """Draft the next step of each sequence this step sampled for and that goes on (draft.py)."""
        assert self.drafter is not None
        work = []
        for seq, token in zip(batch.seqs, tokens):
            seq.proposed, seq.draft_q = [], None
            if token is None or seq.status is Status.FINISHED:
                continue
            run = token if isinstance(token, list) else [token]
            left = (
                seq.params.max_tokens - len(seq.output_ids) - len(run)
            )  # the next step emits one more than it accepts
            if left > 1 and not any(t in seq.stop_ids for t in run):
                work.append((seq, seq.token_ids() + run, min(self.drafter.k, left - 1)))
        self.drafter.propose(work)

    # ---- offline ------------------------------------------------------------------------
    def run(
        self, requests: dict[int, Request], on_token: TokenCallback | None = None
    ) -> tuple[list[Sequence], RunStats]:
        """Generate for requests keyed by their index; returns sequences in key order."""
        seqs = [self.add(i, r) for i, r in sorted(requests.items())]
        start = time.perf_counter()
        self.busy_s = 0.0
        drafted, accepted = self.speculation()
        while self.any_replica(self.has_work()):
            self.step_round(on_token)
        self.links.flush()
        self.prompt_logprobs_out.clear()  # the sequences hold them
        stats = _stats(seqs, start)
        stats.busy_s = self.busy_s
        stats.draft_tokens, stats.accepted_tokens = (a - b for a, b in zip(self.speculation(), (drafted, accepted)))
        return seqs, stats

    def speculation(self) -> tuple[int, int]:
        """Draft tokens verified and accepted so far, over the micro-batches."""
        return sum(s.draft_tokens for s in self.scheds), sum(s.accepted_tokens for s in self.scheds)


def _sample(batch: Batch, raw: torch.Tensor, tokenizer: Callable[[], Tokenizer]) -> Sampled:
    """The last stage's tokens for a step, from its logits [rows, vocab]: each sequence's rows are
    the prompt positions it scores (prompt logprobs), then, when it samples, its last token's and,
    with speculation, its drafts' (which it verifies). Processors (sampling.process) see the tokens
    before each row, drafts included, then a grammar masks the row (structured outputs;
    ``tokenizer`` gives its vocabulary); logprobs come from the raw rows."""
    spans = []  # (sequence index, its first sampling row, its sampling rows)
    prompt: StepLogprobs = [None] * len(batch.seqs)
    row = 0
    for i, yes in enumerate(batch.samples()):
        seq, scored = batch.seqs[i], batch.prompt_rows(i)
        if scored:
            top = cast(int, seq.params.prompt_logprobs)
            prompt[i] = [logprobs_of(raw[row + j], seq.prompt_ids[q + 1], top) for j, q in enumerate(scored)]
            row += len(scored)
        if yes:
            spans.append((i, row, 1 + len(batch.draft(i))))
            row += spans[-1][2]
    logits = raw
    if any(processes(batch.seqs[i].params) for i, _, _ in spans):
        logits = raw.clone()
        for i, first, rows in spans:
            seq, drafts = batch.seqs[i], batch.draft(i)
            if processes(seq.params):
                for j in range(rows):
                    history = seq.output_ids + drafts[:j]
                    logits[first + j] = process(raw[first + j], seq.params, seq.prompt_ids, history, seq.stop_ids)
            if (spec := seq.params.structured_outputs) is not None:  # one row: the front ends refuse drafts with it
                if seq.guide is None:
                    seq.guide = Guide(spec, tokenizer(), raw.shape[-1], seq.output_ids)
                seq.guide.mask(logits[first])
    tokens: StepTokens = [None] * len(batch.seqs)
    if batch.drafts or any(prompt):
        for i, first, rows in spans:
            seq = batch.seqs[i]
            q = None if seq.draft_q is None else seq.draft_q[: rows - 1]  # a draft model's distributions
            tokens[i] = (
                verify(logits[first : first + rows], batch.draft(i), seq.params, seq.generator, q)
                if rows > 1
                else sample(logits[first : first + 1], [seq.params], [seq.generator])[0]
            )
    elif spans:  # one row each, nothing else: sample them together
        picked = [batch.seqs[i] for i, _, _ in spans]
        for (i, _, _), token in zip(spans, sample(logits, [s.params for s in picked], [s.generator for s in picked])):
            tokens[i] = token
    logprobs: StepLogprobs = [None] * len(batch.seqs)
    for i, first, _ in spans:
        k = batch.seqs[i].params.logprobs
        if k is not None:
            emitted = tokens[i]
            run = emitted if isinstance(emitted, list) else [cast(int, emitted)]
            logprobs[i] = [logprobs_of(raw[first + j], t, k) for j, t in enumerate(run)]
    return tokens, logprobs, prompt


def _token_slots(batch: Batch) -> list[int]:
    """Tokens each sequence of a step may emit: 0 (a prompt chunk short of its end), 1, or with
    drafts 1 + their number."""
    return [(1 + len(batch.draft(i))) if yes else 0 for i, yes in enumerate(batch.samples())]


def _entry_width(k: int | None) -> int:
    """Values a logprob entry takes in the step's message: logprob, rank, k (id, logprob) pairs."""
    return 0 if k is None else 2 + 2 * k


def _message_slots(batch: Batch, drafts: int = 0) -> list[int]:
    """Values each sequence takes in the message that carries a step's tokens down the pipeline
    (its prompt logprob entries, then per emitted token its id and logprob entry, then, with a
    draft model, ``drafts`` slots for its next drafts), so that every stage knows its size before
    it arrives."""
    return [
        len(batch.prompt_rows(i)) * _entry_width(s.params.prompt_logprobs)
        + n * (1 + _entry_width(s.params.logprobs))
        + (drafts if n else 0)
        for i, (n, s) in enumerate(zip(_token_slots(batch), batch.seqs))
    ]


def _flat(e: TokenLogprob) -> list[float]:
    return [e.logprob, e.rank, *(x for pair in e.top for x in pair)]


def _entry(v: list[float]) -> TokenLogprob:
    return TokenLogprob(v[0], int(v[1]), tuple((int(v[j]), v[j + 1]) for j in range(2, len(v), 2)))


def _pack(batch: Batch, sampled: Sampled, drafts: int = 0) -> list[float]:
    """A step's emitted tokens (and logprobs) in their slots, then each sequence's next drafts
    (``drafts`` slots), unused slots -1."""
    flat: list[float] = []
    for n, seq, token, entries, prompt in zip(_token_slots(batch), batch.seqs, *sampled):
        for e in prompt or []:
            flat += _flat(e)
        run = [] if token is None else token if isinstance(token, list) else [token]
        for j, t in enumerate(run):
            flat.append(t)
            if entries is not None:
                flat += _flat(entries[j])
        flat += [-1.0] * ((n - len(run)) * (1 + _entry_width(seq.params.logprobs)))
        if n and drafts:
            flat += [*map(float, seq.proposed), *[-1.0] * (drafts - len(seq.proposed))]
    return flat


def _unpack(batch: Batch, flat: list[float], drafts: int = 0) -> Sampled:
    """``_pack``'s message read back; each sequence's next drafts go to its ``proposed``."""
    tokens: StepTokens = []
    logprobs: StepLogprobs = []
    prompt: StepLogprobs = []
    at = 0
    for i, (n, seq) in enumerate(zip(_token_slots(batch), batch.seqs)):
        pw = _entry_width(seq.params.prompt_logprobs)
        scored = len(batch.prompt_rows(i))
        prompt.append([_entry(flat[at + j * pw : at + (j + 1) * pw]) for j in range(scored)] if scored else None)
        at += scored * pw
        width = 1 + _entry_width(seq.params.logprobs)
        slots = [flat[at + j * width : at + (j + 1) * width] for j in range(n)]
        slots = [v for v in slots if v[0] >= 0]
        at += n * width
        run = [int(v[0]) for v in slots]
        if n and drafts:
            seq.proposed = [int(v) for v in flat[at : at + drafts] if v >= 0]
            at += drafts
        tokens.append(None if n == 0 else run if batch.draft(i) else run[0])
        logprobs.append([_entry(v[1:]) for v in slots] if n and seq.params.logprobs is not None else None)
    return tokens, logprobs, prompt


def _stats(seqs: list[Sequence], start: float) -> RunStats:
    end = time.perf_counter()
    firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
    stats = RunStats(
        elapsed_s=end - start,
        prompt_tokens=sum(len(s.prompt_ids) for s in seqs),
        generated_tokens=sum(len(s.output_ids) for s in seqs),
    )
    if firsts:
        stats.first_token_s = min(firsts) - start
        stats.decode_s = end - min(firsts)
        stats.decode_tokens = sum(max(0, len(s.output_ids) - 1) for s in seqs)
    return stats

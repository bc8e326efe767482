"""Scheduler + BlockManager + Sequence, driven by a deterministic fake model (pure Python).

The fake "model" keeps a simulated paged KV cache: every step writes each fed token into
the slot its block table names, and a sampled token is a hash of the context *read back
from those slots* (positions [0, num_computed + count)), which is what a real model
attends to. So a wrong block table, a wrongly shared prefix block or a stale block shows
up as a wrong token, and any correct schedule (chunking, batching, preemption and
recompute, prefix reuse) must reproduce ``reference``: the tokens of an unlimited run that
feeds each history straight to the model. Everything is integers; comparisons are exact.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from shardlm.engine.block_manager import BlockManager, block_hash
from shardlm.engine.sampling import SamplingParams
from shardlm.engine.scheduler import Batch, Scheduler, SchedulerConfig
from shardlm.engine.sequence import Sequence, Status
from shardlm.engine.speculative import SpeculativeConfig, propose
from shardlm.errors import UsageError

VOCAB = 97


def fake_next(ids: list[int]) -> int:
    """A deterministic 'model': a polynomial hash of the whole token history, mod VOCAB."""
    h = 17
    for t in ids:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def cyclic_next(ids: list[int]) -> int:
    """A 'model' that falls into cycles (its output depends on the last two tokens only), so
    n-gram drafts are often right and sometimes wrong."""
    return (ids[-1] * 5 + (ids[-2] if len(ids) > 1 else 0) * 3 + 1) % 11


def reference(prompt: list[int], params: SamplingParams, eos_ids=(), model=fake_next) -> tuple[list[int], str]:
    """Outputs and finish reason with no scheduler at all: feed the history, append, repeat."""
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    out: list[int] = []
    while True:
        out.append(model(prompt + out))
        if out[-1] in stop:
            return out, "stop"
        if len(out) >= params.max_tokens:
            return out, "length"


def prompt(i: int, n: int) -> list[int]:
    return [(i * 7 + j * 3 + 1) % VOCAB for j in range(n)]


def seq(i: int, n: int | list[int], max_tokens: int = 8, eos=(), **kw) -> Sequence:
    ids = prompt(i, n) if isinstance(n, int) else n
    return Sequence(i, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), eos_ids=eos)


class CheckedScheduler(Scheduler):
    """Records preemptions and checks each victim is the newest running sequence."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.preempted: list[int] = []
        self.log: list[tuple[str, int, int]] = []  # ("preempt" | "admit", id, num_tokens then)

    def _preempt(self, s: Sequence) -> None:
        assert s is self.running[-1], "the victim must be the newest running sequence"
        assert self.blocks.num_free == 0, "preempted although a block was free"
        self.preempted.append(s.id)
        self.log.append(("preempt", s.id, s.num_tokens))
        super()._preempt(s)
        assert self.waiting[0] is s and s.block_table == [] and s.num_computed == 0


class Driver:
    """Runs a scheduler with the fake model, checking invariants every step. With drafts
    (speculative decoding) the model verifies them greedily from the cache's contents."""

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True, model=fake_next, **cfg):
        self.model = model
        self.bm = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)
        self.cfg = SchedulerConfig(**cfg)
        self.s = CheckedScheduler(self.bm, self.cfg)
        self.kv = [None] * (num_blocks * block_size)  # the token whose K/V each slot holds
        self.steps: list[list[tuple[int, int]]] = []  # per step: (seq id, count) in batch order
        self.sampled: list[set[int]] = []  # per step: ids that got a token
        self.seqs: list[Sequence] = []
        self.admitted: dict[int, int] = {}  # id -> step of its latest admission

    def add(self, *seqs: Sequence) -> None:
        for s in seqs:
            self.s.add(s)
            self.seqs.append(s)

    def abort(self, s: Sequence) -> None:
        self.s.abort(s)
        assert s.status is Status.FINISHED and s.finish_reason == "abort" and s.block_table == []
        assert s not in self.s.running and s not in self.s.waiting
        self.check_blocks()

    def slot(self, s: Sequence, p: int) -> int:
        bs = self.bm.block_size
        return s.block_table[p // bs] * bs + p % bs

    def check_blocks(self) -> None:
        bm, held = self.bm, Counter()
        for s in self.s.running:
            assert len(set(s.block_table)) == len(s.block_table), "a block twice in one table"
            held.update(s.block_table)
            assert s.num_computed <= len(s.block_table) * bm.block_size
        for s in self.s.waiting:
            assert s.block_table == [] and s.num_computed == 0 and s.status is Status.WAITING
        # a shared prefix block counts once per holder; a free block is held by no one
        assert bm.ref_counts == [held[b] for b in range(bm.num_blocks)]
        assert set(bm.free_ids) == {b for b in range(bm.num_blocks) if held[b] == 0}
        assert {bm.block_of[h]: h for h in bm.block_of} == bm.hash_of
        if not bm.prefix_caching:
            assert bm.hash_of == {}
        for s in self.s.running:  # a named block holds what its name says
            h = 0
            for i in range(s.num_computed // bm.block_size):
                h = block_hash(h, s.tokens(i * bm.block_size, (i + 1) * bm.block_size))
                b, bs = s.block_table[i], bm.block_size
                assert bm.hash_of.get(b, h) == h
                assert self.kv[b * bs : (b + 1) * bs] == s.tokens(i * bs, (i + 1) * bs)

    def step(self) -> Batch:
        s, bm = self.s, self.bm
        before = list(s.running)
        n_pre = len(s.preempted)
        batch = s.schedule()
        k = len(self.steps)
        assert batch.seqs, "empty step while work remains (the engine raises on this)"
        assert len(batch.seqs) == len(batch.counts) == len({x.id for x in batch.seqs})
        victims = s.preempted[n_pre:]
        for x in s.running:
            if x not in before or x.id in victims:  # (a victim may come back in the same step)
                self.admitted[x.id] = k
                s.log.append(("admit", x.id, x.num_tokens))
        # running stays in admission order, so running[-1] (the victim) is the newest
        order = [self.admitted[x.id] for x in s.running]
        assert order == sorted(order)
        assert len(s.running) <= self.cfg.max_num_seqs and len(batch.seqs) <= self.cfg.max_num_seqs
        dec = [n == 1 and x.is_decoding for x, n in zip(batch.seqs, batch.counts)]
        assert dec == sorted(dec), "prefill chunks must come before single-token steps"
        drafts = [batch.draft(i) for i in range(len(batch.seqs))]
        for x, n, dr in zip(batch.seqs, batch.counts, drafts):
            assert x.status is Status.RUNNING and x in s.running
            assert 1 <= n <= x.num_tokens - x.num_computed + len(dr)
            assert not dr or (x.is_decoding and n == 1 + len(dr)), "drafts only follow a decode's token"
            assert len(x.block_table) * bm.block_size >= x.num_computed + n  # table covers the writes
        # every decoding sequence still running gets exactly one token (and its drafts)
        for x in s.running:
            if x.is_decoding:
                i = batch.seqs.index(x)
                assert batch.counts[i] == 1 + len(drafts[i])
        for x in before:
            assert x in batch.seqs or x.id in victims or not x.is_decoding
        # the token budget; only decodes of already-running sequences may go past it
        if batch.num_tokens() > self.cfg.max_num_batched_tokens:
            assert all(dec) and all(x in before for x in batch.seqs), (k, batch.counts)
        self.check_blocks()
        # the fake model: write K/V (never into a block another sequence shares), then read
        written = set()
        for x, n, dr in zip(batch.seqs, batch.counts, drafts):
            fed = x.tokens(x.num_computed, x.num_computed + n - len(dr)) + dr
            for p, token in zip(range(x.num_computed, x.num_computed + n), fed):
                sl = self.slot(x, p)
                assert bm.ref_counts[sl // bm.block_size] == 1, "write into a shared block"
                assert sl not in written
                written.add(sl)
                self.kv[sl] = token
        tokens = []
        for x, n, yes, dr in zip(batch.seqs, batch.counts, batch.samples(), drafts):
            assert yes == (x.num_computed + n - len(dr) == x.num_tokens)
            # what this entry attends to: its whole context, read back through its block table
            ctx = [self.kv[self.slot(x, p)] for p in range(x.num_computed + n)]
            assert ctx == x.tokens(0, x.num_computed + n - len(dr)) + dr, "the cache holds the wrong tokens"
            if not yes:
                tokens.append(None)
                continue
            run = []  # greedy verification: accept drafts while the model agrees, then its own token
            for i in range(len(dr) + 1):
                run.append(self.model(ctx[: x.num_tokens + i]))
                if i == len(dr) or run[-1] != dr[i]:
                    break
            tokens.append(run if dr else run[0])
        self.steps.append([(x.id, n) for x, n in zip(batch.seqs, batch.counts)])
        self.sampled.append({x.id for x, t in zip(batch.seqs, tokens) if t is not None})
        done = s.update(batch, tokens)
        for x in done:
            assert x.status is Status.FINISHED and x.block_table == [] and x not in s.running
        assert {x.id for x in batch.seqs if x.status is Status.FINISHED} == {x.id for x in done}
        self.check_blocks()
        return batch

    def run(
        self,
        max_steps: int = 5000,
        arrivals: dict[int, list[Sequence]] | None = None,
        aborts: dict[int, list[int]] | None = None,
    ) -> list[Sequence]:
        """Steps until no work is left; ``arrivals``/``aborts`` happen before the given step."""
        arrivals, aborts = dict(arrivals or {}), dict(aborts or {})
        while self.s.has_work() or arrivals:
            k = len(self.steps)
            self.add(*arrivals.pop(k, []))
            for x in [x for x in self.seqs if x.id in aborts.pop(k, ())]:
                if x.status is not Status.FINISHED:
                    self.abort(x)
            if self.s.has_work():
                self.step()
            else:
                self.steps.append([])
                self.sampled.append(set())
            assert len(self.steps) < max_steps, "no progress"
        assert all(c == 0 for c in self.bm.ref_counts) and self.bm.num_free == self.bm.num_blocks
        assert all(x.status is Status.FINISHED and x.block_table == [] for x in self.seqs)
        return self.seqs

    def check_outputs(self, eos=()) -> None:
        for x in self.seqs:
            if x.finish_reason != "abort":
                assert (x.output_ids, x.finish_reason) == reference(x.prompt_ids, x.params, eos, self.model), x.id


def steps_of(d: Driver, i: int) -> list[tuple[int, int]]:
    """(step, count) of every step that fed sequence ``i``."""
    return [(k, n) for k, st in enumerate(d.steps) for j, n in st if j == i]


# ---- the driver itself ----------------------------------------------------------------


def test_unlimited_run_matches_reference_and_the_model_is_not_trivial():
    d = Driver(1000, 4, max_num_batched_tokens=10**6)
    d.add(*[seq(i, n, max_tokens=12) for i, n in enumerate([3, 9, 1, 17])])
    d.run()
    d.check_outputs()
    # everything is prefilled in one step (a 1-token prompt is a step over an empty
    # context, listed last), then each step decodes every sequence
    assert d.steps[0] == [(0, 3), (1, 9), (3, 17), (2, 1)]
    assert d.steps[1:] == [[(0, 1), (1, 1), (2, 1), (3, 1)]] * 11
    assert d.s.preempted == []
    # can-fail guard: the fake model depends on the history (no two outputs alike, not constant)
    outs = [tuple(x.output_ids) for x in d.seqs]
    assert len(set(outs)) == 4 and all(len(set(o)) > 4 for o in outs)


def test_driver_catches_a_wrong_block_table():
    """The KV simulation is not vacuous: two sequences' blocks swapped (ref counts still
    consistent) are caught as reading the wrong tokens."""
    d = Driver(64, 4)
    a, b = seq(0, 9), seq(1, 9)
    d.add(a, b)
    d.step()
    a.block_table[0], b.block_table[0] = b.block_table[0], a.block_table[0]
    with pytest.raises(AssertionError):
        d.step()


# ---- chunked prefill and continuous batching ------------------------------------------


def test_long_prompt_is_chunked_while_others_keep_decoding():
    d = Driver(64, 4, max_num_batched_tokens=8)
    a, long = seq(0, 3, max_tokens=12), seq(1, 30, max_tokens=3)
    d.run(arrivals={0: [a], 2: [long]})
    d.check_outputs()
    assert d.steps[:2] == [[(0, 3)], [(0, 1)]]
    # the 30-token prompt arrives at step 2 and gets what the budget leaves beside a's
    # decode (8 - 1 = 7 tokens a step): 7, 7, 7, 7, 2; a decodes in every one of those steps
    assert d.steps[2:7] == [[(1, 7), (0, 1)]] * 4 + [[(1, 2), (0, 1)]]
    assert d.steps[7:9] == [[(0, 1), (1, 1)]] * 2
    assert all(0 in got for got in d.sampled[:12]) and len(d.steps) == 12
    # chunks that do not reach the end of the prompt sample nothing
    assert [1 in got for got in d.sampled[2:9]] == [False] * 4 + [True] * 3


@pytest.mark.parametrize(
    "budget,length,chunks", [(5, 23, [5, 5, 5, 5, 3]), (8, 8, [8]), (8, 9, [8, 1]), (1, 4, [1, 1, 1, 1]), (7, 3, [3])]
)
def test_prompt_is_prefilled_in_budget_sized_chunks(budget, length, chunks):
    d = Driver(64, 4, max_num_batched_tokens=budget)
    d.add(seq(0, length, max_tokens=3))
    d.run()
    d.check_outputs()
    assert [n for _, n in steps_of(d, 0)] == chunks + [1, 1]
    assert [bool(got) for got in d.sampled] == [False] * (len(chunks) - 1) + [True] * 3


def test_new_sequences_join_the_running_batch_between_steps():
    d = Driver(64, 4, max_num_batched_tokens=16)
    a, b, c, e = seq(0, 5, 10), seq(1, 2, 10), seq(2, 4, 4), seq(3, 6, 4)
    d.run(arrivals={0: [a, b], 3: [c], 5: [e]})
    d.check_outputs()
    assert d.steps[0] == [(0, 5), (1, 2)]
    assert d.steps[3] == [(2, 4), (0, 1), (1, 1)]  # c's prompt beside a's and b's decodes
    assert d.steps[5] == [(3, 6), (0, 1), (1, 1), (2, 1)]
    assert d.steps[6] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    # nobody waited for anyone: each gets one token a step from its first step to its last
    for x in d.seqs:
        fed = [k for k, _ in steps_of(d, x.id)]
        assert fed == list(range(fed[0], fed[0] + len(x.output_ids)))


def test_max_num_seqs_caps_the_running_batch():
    d = Driver(64, 4, max_num_seqs=2)
    d.add(seq(0, 3, 2), seq(1, 3, 6), seq(2, 3, 2), seq(3, 3, 2))
    d.run()
    d.check_outputs()
    assert max(len(st) for st in d.steps) == 2
    # seq 0 finishes at step 1 and seq 2 takes its place at once, beside seq 1's decodes;
    # seq 2 finishes at step 3 and seq 3 follows the same way
    assert d.steps[:6] == [
        [(0, 3), (1, 3)],
        [(0, 1), (1, 1)],
        [(2, 3), (1, 1)],
        [(1, 1), (2, 1)],
        [(3, 3), (1, 1)],
        [(1, 1), (3, 1)],
    ]


def test_decodes_go_past_the_token_budget_only_as_far_as_max_num_seqs():
    """Decodes come first, one token each, and are never cut for the budget (a prompt
    never stalls them); ``max_num_seqs`` is what bounds them. The budget is lowered
    between steps to get more decoding sequences than budget tokens."""
    d = Driver(64, 4, max_num_seqs=5, max_num_batched_tokens=100)
    d.add(*[seq(i, 2, 6) for i in range(5)])
    d.step()
    d.cfg = d.s.config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=2)
    d.add(seq(5, 3, 2))
    d.step()
    assert d.steps[-1] == [(i, 1) for i in range(5)]  # 5 tokens > budget 2; seq 5 waits
    assert [x.id for x in d.s.waiting] == [5]
    d.run()
    d.check_outputs()
    # 5 decodes use up the budget, so seq 5 waits until they are done, then is chunked 2 + 1
    assert d.steps[1:] == [[(i, 1) for i in range(5)]] * 5 + [[(5, 2)], [(5, 1)], [(5, 1)]]


# ---- preemption -----------------------------------------------------------------------


def test_preemption_takes_the_newest_running_sequences_first():
    d = Driver(3, 2, max_num_batched_tokens=100)
    d.add(*[seq(i, 2, 4) for i in range(4)])
    d.step()
    assert d.steps[0] == [(0, 2), (1, 2), (2, 2)] and d.bm.num_free == 0  # seq 3 waits for blocks
    d.step()
    # seq 0 needs a second block: seq 2 (newest) goes; seq 1 then needs one: seq 1 is the newest
    assert d.s.preempted == [2, 1] and d.s.preemptions == 2  # counted for vllm:num_preemptions
    assert d.steps[1] == [(0, 1)]
    # back at the front of the queue, in admission order, ahead of the never-admitted seq 3
    assert [x.id for x in d.s.waiting] == [1, 2, 3]
    assert all(x.output_ids for x in d.seqs[:3])  # they keep what they generated
    d.run()
    d.check_outputs()


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize(
    "num_blocks,block_size,lengths,max_tokens,budget",
    [
        (8, 4, [5, 6, 7, 3], 10, 8192),
        (5, 4, [5, 6, 7, 3, 2], 8, 6),
        (6, 2, [1, 2, 3, 4], 7, 3),
        (3, 8, [7, 9, 2], 12, 8192),
        (5, 3, [2, 4, 3, 10], 4, 5),
    ],
)
def test_preemption_and_recompute_do_not_change_outputs(
    num_blocks, block_size, lengths, max_tokens, budget, prefix_caching
):
    d = Driver(num_blocks, block_size, prefix_caching=prefix_caching, max_num_batched_tokens=budget)
    d.add(*[seq(i, n, max_tokens) for i, n in enumerate(lengths)])
    d.run()
    d.check_outputs()
    assert d.s.preempted, "the layout was meant to force preemption"
    # each victim came back with what it had generated (its history is recomputed, from
    # scratch or from what the prefix cache still holds of it)
    for v in set(d.s.preempted):
        events = [(what, n) for what, i, n in d.s.log if i == v]
        assert events[0] == ("admit", lengths[v])
        for (what, n), (then, m) in itertools.pairwise(events):
            if what == "preempt":
                assert (then, m) == ("admit", n)
        assert len(events) % 2 == 1


# ---- abort ----------------------------------------------------------------------------


def test_abort_waiting_running_and_partially_prefilled_sequences():
    d = Driver(16, 4, max_num_batched_tokens=6, max_num_seqs=3)
    run, part, wait, other = seq(0, 3, 20), seq(1, 30, 5), seq(2, 5, 5), seq(3, 4, 6)
    d.add(run, part, wait, other)
    d.step()
    d.step()
    d.step()
    assert run.is_decoding and len(run.block_table) == 2
    assert 0 < part.num_computed < 30 and not part.is_decoding and part.block_table
    assert wait.status is Status.WAITING and other.status is Status.WAITING
    for x in (part, wait, run):
        free = d.bm.num_free
        held = len(x.block_table)
        d.abort(x)  # checks ref counts and that it left every queue
        assert d.bm.num_free == free + held
    assert d.s.running == [] and [x.id for x in d.s.waiting] == [3]
    d.run()
    d.check_outputs()
    assert other.finish_reason == "length" and run.output_ids and run.finish_reason == "abort"


def test_abort_of_a_sequence_sharing_prefix_blocks_keeps_them_for_the_other():
    d = Driver(16, 4)
    shared = prompt(9, 8)
    a, b = seq(0, shared + [1, 2], 6), seq(1, shared + [3], 6)
    d.run(arrivals={0: [a], 2: [b]}, aborts={4: [0]})
    d.check_outputs()
    assert b.num_cached == 8 and a.finish_reason == "abort" and b.finish_reason == "length"


def test_abort_while_the_step_is_in_flight_is_skipped_by_update():
    bm = BlockManager(16, 4)
    s = Scheduler(bm)
    a, b = seq(0, 6), seq(1, 5)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    s.abort(a)
    assert bm.ref_counts.count(1) == 2  # only b's blocks
    done = s.update(batch, [fake_next(x.token_ids()) for x in batch.seqs])
    assert done == [] and a.output_ids == [] and a.num_computed == 0 and a.block_table == []
    assert b.num_computed == 5 and len(b.output_ids) == 1 and s.running == [b]


# ---- capacity -------------------------------------------------------------------------


def test_add_refuses_a_request_that_could_never_fit():
    s = Scheduler(BlockManager(2, 4))  # 8 KV slots
    x = seq(0, 8, max_tokens=10)  # its last step holds 8 + 10 - 1 = 17 tokens' K/V
    with pytest.raises(UsageError) as err:
        s.add(x)
    msg = str(err.value)
    assert "8 prompt tokens" in msg and "up to 10 new" in msg and "needs 17 KV-cache slots" in msg
    assert "holds 8" in msg
    assert not s.has_work()
    with pytest.raises(UsageError, match="needs 9 KV-cache slots"):
        s.add(seq(1, 5, max_tokens=5))


def test_a_request_that_needs_exactly_the_whole_cache_runs():
    d = Driver(2, 4, max_num_batched_tokens=3)
    d.add(seq(0, 5, max_tokens=4))  # 5 + 4 - 1 = 8 slots, all of them
    peak = 0
    while d.s.has_work():
        d.step()
        peak = max(peak, d.bm.num_used)
    d.check_outputs()
    assert peak == 2 and len(d.seqs[0].output_ids) == 4


# ---- stop conditions ------------------------------------------------------------------


def test_stop_on_eos_stop_token_ids_and_max_tokens_through_the_scheduler():
    free_run, _ = reference(prompt(0, 5), SamplingParams(temperature=0.0, max_tokens=10))
    eos = free_run[2]  # what seq 0 generates third
    assert eos not in free_run[:2]
    d = Driver(32, 4)
    a = seq(0, 5, 10, eos=(eos,))
    b = seq(0, 5, 10, eos=(eos,), ignore_eos=True)
    c = seq(0, 5, 10, stop_token_ids=(eos,))
    e = seq(0, 5, 10, eos=(eos,), ignore_eos=True, stop_token_ids=(free_run[4],))
    f = seq(0, 5, 2, eos=(eos,))
    for i, x in enumerate((a, b, c, e, f)):
        x.id = i
    d.add(a, b, c, e, f)
    d.run()
    d.check_outputs((eos,))
    assert (a.output_ids, a.finish_reason) == (free_run[:3], "stop")
    assert (b.output_ids, b.finish_reason) == (free_run, "length")  # EOS ignored
    assert (c.output_ids, c.finish_reason) == (free_run[:3], "stop")
    assert (e.output_ids, e.finish_reason) == (free_run[:5], "stop")  # stop ids still honoured
    assert (f.output_ids, f.finish_reason) == (free_run[:2], "length")
    # a stops at its third token (step 2) and is fed nothing after it
    assert steps_of(d, 0)[-1][0] == 2 and steps_of(d, 1)[-1][0] == 9


def test_stop_token_that_is_also_the_last_allowed_one_reports_stop():
    x = Sequence(0, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), eos_ids=(7,))
    x.append(4)
    assert x.status is Status.WAITING and x.finish_reason is None
    x.append(7)
    assert (x.status, x.finish_reason) == (Status.FINISHED, "stop")
    y = Sequence(0, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), eos_ids=(7,))
    y.append(4)
    y.append(5)
    assert y.finish_reason == "length"


# ---- prefix caching through the scheduler ---------------------------------------------


def test_prefix_hit_leaves_a_single_token_step_listed_after_chunks():
    d = Driver(32, 4)
    a = seq(0, prompt(5, 9), 6)
    b = seq(1, prompt(5, 9), 6)  # the same prompt: 2 full blocks cached, 1 token to feed
    c = seq(2, prompt(5, 8) + [0, 0, 0], 6)  # the same 8 first tokens, then its own 3
    d.run(arrivals={0: [a], 3: [b, c]})
    d.check_outputs()
    assert d.steps[3] == [(2, 3), (0, 1), (1, 1)]
    assert b.output_ids == a.output_ids and c.output_ids != a.output_ids
    assert (b.num_cached, c.num_cached) == (8, 8)
    assert (d.bm.hits, d.bm.queries) == (16, 9 + 9 + 11)


def test_prefix_caching_off_shares_nothing():
    d = Driver(32, 4, prefix_caching=False)
    a, b = seq(0, prompt(5, 9), 6), seq(1, prompt(5, 9), 6)
    d.run(arrivals={0: [a], 3: [b]})
    d.check_outputs()
    assert d.steps[3] == [(1, 9), (0, 1)] and b.num_cached == 0 and d.bm.hits == 0


# ---- random workloads -----------------------------------------------------------------


def random_workload(rng: random.Random):
    bs, nb = rng.choice([1, 2, 3, 4]), rng.randint(2, 14)
    cfg = dict(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(1, 20))
    systems = [[rng.randrange(VOCAB) for _ in range(rng.randint(0, 9))] for _ in range(2)]
    eos = (rng.randrange(VOCAB),) if rng.random() < 0.5 else ()
    arrivals, aborts = {}, {}
    for i in range(rng.randint(1, 7)):
        p = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.4:
            p += [rng.randrange(VOCAB) for _ in range(rng.randint(0, nb * bs))]
        params = SamplingParams(
            temperature=0.0,
            max_tokens=rng.randint(1, 10),
            ignore_eos=rng.random() < 0.2,
            stop_token_ids=(rng.randrange(VOCAB),) if rng.random() < 0.2 else (),
        )
        if len(p) + params.max_tokens - 1 <= nb * bs:
            arrivals.setdefault(rng.choice([0, 0, 0, rng.randint(0, 12)]), []).append(
                Sequence(i, p, params, eos_ids=eos)
            )
            if rng.random() < 0.15:
                aborts.setdefault(rng.randint(0, 15), []).append(i)
    return Driver(nb, bs, prefix_caching=rng.random() < 0.7, **cfg), arrivals, aborts, eos


def test_random_workloads_keep_every_invariant_and_the_reference_outputs():
    seen = Counter()
    for seed in range(250):
        d, arrivals, aborts, eos = random_workload(random.Random(seed))
        try:
            d.run(arrivals=arrivals, aborts=aborts)
            d.check_outputs(eos)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from e
        seen["preempted"] += bool(d.s.preempted)
        seen["prefix hit"] += d.bm.hits > 0
        seen["aborted"] += any(x.finish_reason == "abort" for x in d.seqs)
        seen["stopped"] += any(x.finish_reason == "stop" for x in d.seqs)
        # a chunk that stops short of the end of its prompt samples nothing
        seen["chunked"] += any(n > 1 and i not in got for st, got in zip(d.steps, d.sampled) for i, n in st)
    # can-fail guard: the workloads really exercise every path
    assert min(seen[k] for k in ("preempted", "prefix hit", "aborted", "stopped", "chunked")) >= 10, seen


# ---- the engine's micro-batches share one block manager -------------------------------


def test_micro_batches_sharing_blocks_do_not_deadlock_on_chunked_prompts():
    bm = BlockManager(4, 1)  # 4 slots; each request alone needs 4 + 1 - 1 = 4
    cfg = SchedulerConfig(max_num_batched_tokens=2)
    scheds = [Scheduler(bm, cfg), Scheduler(bm, cfg)]  # as Engine(micro_batches=2) builds them
    seqs = [seq(0, 4, 1), seq(1, 4, 1)]
    for s, x in zip(scheds, seqs):
        s.add(x)
    for _ in range(20):
        batches = [s.schedule() if s.has_work() else Batch([], []) for s in scheds]
        # the engine raises when no micro-batch stepped while work remains
        assert any(b.seqs for b in batches) or not any(s.has_work() for s in scheds), [
            (x.num_computed, x.status) for x in seqs
        ]
        for s, b in zip(scheds, batches):
            s.update(b, [fake_next(x.token_ids()) if y else None for x, y in zip(b.seqs, b.samples())])
    assert [(x.output_ids, x.finish_reason) for x in seqs] == [reference(x.prompt_ids, x.params) for x in seqs]


# ---- speculative decoding (n-gram drafts) -----------------------------------------------

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize(
    "num_blocks,block_size,lengths,max_tokens,budget",
    [
        (1000, 4, [5, 6, 7, 3], 30, 8192),  # room for every draft
        (9, 4, [5, 6, 7, 3], 20, 8192),  # blocks run out: drafts shrink, sequences are preempted
        (40, 2, [1, 2, 9, 4], 25, 5),  # a budget that leaves few tokens for drafts
    ],
)
def test_speculative_decoding_keeps_outputs(num_blocks, block_size, lengths, max_tokens, budget, prefix_caching):
    d = Driver(
        num_blocks,
        block_size,
        prefix_caching=prefix_caching,
        model=cyclic_next,
        max_num_batched_tokens=budget,
        speculative=SPEC,
    )
    d.add(*[seq(i, prompt(i, n) if n > 1 else [i], max_tokens, eos=(10,)) for i, n in enumerate(lengths)])
    d.run()
    d.check_outputs(eos=(10,))
    s = d.s
    # it can fail: drafts were fed, many accepted, some rejected (their stale K/V overwritten later)
    assert s.draft_tokens > s.accepted_tokens > 0, (s.draft_tokens, s.accepted_tokens)
    plain = Driver(
        num_blocks, block_size, prefix_caching=prefix_caching, model=cyclic_next, max_num_batched_tokens=budget
    )
    plain.add(*[seq(i, prompt(i, n) if n > 1 else [i], max_tokens, eos=(10,)) for i, n in enumerate(lengths)])
    plain.run()
    assert [x.output_ids for x in plain.seqs] == [x.output_ids for x in d.seqs]
    assert len(d.steps) < len(plain.steps)  # accepted drafts save steps


def test_drafts_stop_at_max_tokens_and_a_stop_token():
    d = Driver(1000, 4, model=cyclic_next, speculative=SpeculativeConfig(num_speculative_tokens=8))
    x = seq(0, [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3)
    d.add(x)
    d.run()
    d.check_outputs()
    # after the first token, 2 more may come: one draft and the model's own token at most
    assert all(n <= 2 for st in d.steps[1:] for _, n in st)
    # a stop token inside an accepted run ends the sequence there
    for eos in set(
        reference([1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(temperature=0.0, max_tokens=30), (), cyclic_next)[0][3:]
    ):
        d = Driver(1000, 4, model=cyclic_next, speculative=SpeculativeConfig(num_speculative_tokens=8))
        d.add(seq(0, [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=30, eos=(eos,)))
        d.run()
        d.check_outputs(eos=(eos,))


def test_drafts_never_preempt():
    """With every block taken, a decode gets its next token but no drafts."""
    spec = SpeculativeConfig(num_speculative_tokens=4)
    d = Driver(4, 2, model=cyclic_next, speculative=spec)
    a, b = seq(0, [1, 2, 1], max_tokens=3), seq(1, [3, 4, 3], max_tokens=3)  # 2 blocks each: the cache is full
    d.add(a, b)
    d.step()
    assert propose(a.token_ids(), spec, 4), "a has a draft to offer"
    batch = d.step()
    assert batch.counts == [1, 1] and batch.drafts is None
    assert d.bm.num_free == 0 and d.s.preempted == []


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    s = Scheduler(BlockManager(16, 4), SchedulerConfig(speculative=SpeculativeConfig(num_speculative_tokens=3)))
    x = seq(0, [5, 6, 7, 5], max_tokens=10, eos=(7,))
    s.add(x)
    s.update(s.schedule(), [6])  # the prompt's step samples 6
    batch = s.schedule()
    assert batch.seqs == [x] and batch.drafts == [[7, 5, 6]] and batch.counts == [4]  # what followed "5 6"
    done = s.update(batch, [[7, 5, 6, 9]])  # all three drafts accepted, then 9
    assert done == [x] and x.output_ids == [6, 7] and x.finish_reason == "stop"
    assert s.running == [] and s.blocks.num_free == 16 and (s.draft_tokens, s.accepted_tokens) == (3, 3)


def test_drafts_shrink_to_the_free_slots_and_rejected_ones_give_their_blocks_back():
    spec = SpeculativeConfig(num_speculative_tokens=6)
    s = Scheduler(BlockManager(5, 4), SchedulerConfig(speculative=spec))
    x = seq(0, [1, 2, 3, 4, 5, 1, 2], max_tokens=10)  # 2 blocks for the prompt and the next token
    z = seq(1, [10, 11, 12, 13, 14, 15, 16], max_tokens=10)  # 2 more: one block stays free
    s.add(x)
    s.add(z)
    s.update(s.schedule(), [3, 17])
    batch = s.schedule()  # "1 2 3" occurred: 5 tokens followed, but the free block holds only 4
    assert batch.seqs == [x, z] and batch.drafts == [[4, 5, 1, 2], []] and s.blocks.num_free == 0
    s.update(batch, [[4, 9], 18])  # the second draft rejected, 9 instead
    assert x.output_ids == [3, 4, 9] and (x.num_computed, x.num_tokens) == (9, 10)
    assert len(x.block_table) == 3  # 10 tokens: 3 blocks still needed
    s = Scheduler(BlockManager(3, 4), SchedulerConfig(speculative=spec))
    y = seq(1, [1, 2, 3, 1, 2, 3], max_tokens=6)
    s.add(y)
    s.update(s.schedule(), [1])
    batch = s.schedule()
    assert batch.drafts == [[2, 3, 1]] and len(y.block_table) == 3 and s.blocks.num_free == 0
    s.update(batch, [[9]])  # every draft rejected: 8 tokens fit in 2 blocks, the third goes back
    assert y.output_ids == [1, 9] and y.num_computed == 7 and len(y.block_table) == 2 and s.blocks.num_free == 1

"""The serving front end: requests arrive at any time, tokens stream back as they come.

``AsyncLLM`` starts the ranks (always as child processes, so the event loop never
computes), puts them in their serving loop (``serve_loop``), and routes each request
to the replica with the least outstanding work (disaggregated: to a prefill replica,
which hands it on to a decode replica once its first token is out). A reader thread turns the leaders'
events into per-request asyncio queues. A rank that fails or dies fails every
request in flight with ``EngineDead`` and marks the engine unhealthy; it never hangs.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from shardlm.engine.disagg import Handoff
from shardlm.engine.engine import Request
from shardlm.engine.llm import EngineFront
from shardlm.engine.sampling import SamplingParams, TokenLogprob
from shardlm.errors import RankFailure, UsageError
from shardlm.launch import LocalRanks, readable
from shardlm.models.loader import Checkpoint
from shardlm.parallel.eplb import imbalance


class QueueFull(RuntimeError):
    """More requests are waiting than the server accepts; retry later (HTTP 429)."""


class EngineDead(RuntimeError):
    """A rank failed; the engine cannot serve any more (HTTP 503)."""


@dataclass
class StreamOutput:
    token_ids: list[int]  # new tokens since the previous output
    index: int = 0  # which completion of the call (generate_choices): prompt * n + choice
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when the params ask for logprobs
    finish_reason: str | None = None  # "stop", "length" or "abort" on the last output
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (on the last output)
    stop_reason: int | str | None = None  # the stop token id or string that ended it (on the last output)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1, 2, ... as scored
    queue_s: float | None = None  # seconds it waited for its first step on its replica (on the last output)


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    replica: int  # where the request is now (a decode replica once handed off)
    work: dict[int, int]  # tokens counted against each replica it occupies, until it leaves
    index: int  # of its completion among its call's (prompt * n + choice)


class AsyncLLM(EngineFront):
    _ranks: LocalRanks  # always its own, started by __init__

    def __init__(self, model: str | Checkpoint = "smollm2", *, max_queue: int = 1024, **options):
        super().__init__(model, options)
        self.max_queue = max_queue
        start = time.perf_counter()
        infos = self._spawn_ranks()
        self.load_s = time.perf_counter() - start
        self._took_ready(infos)
        self._ids = itertools.count()
        self._streams: dict[int, _Stream] = {}
        replicas = len(self._replica_leaders)
        self._load = [0] * replicas  # outstanding tokens per replica
        # disaggregated: prompts go to the first prefill_replicas, then on to one of the others
        split = self.config.prefill_replicas
        self._prefill = list(range(split or replicas))
        self._decode = list(range(split, replicas)) if split else None
        self._block_bytes = [0] * replicas  # a replica's ranks are not consecutive when pp > 1 (pp is outermost)
        for i in infos:
            self._block_bytes[i["coords"]["dp"]] += i["kv_block_bytes"]
        self._lock = threading.Lock()
        self.error: str | None = None
        self.stats = {
            "waiting": 0,
            "running": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": self.kv_blocks,
            "prefix_cache_hits": 0,
            "prefix_cache_queries": 0,
            "spec_draft_tokens": 0,
            "spec_accepted_tokens": 0,
            "handoffs_recomputed": 0,
            "num_preemptions": 0,
            "expert_load": None,
        }
        self._replica_stats = [dict(self.stats) for _ in self._replica_leaders]
        self._handoffs = {"kv_handoffs": 0, "kv_transfer_bytes": 0}  # counted here, from the handoff events
        self.stats.update(self._handoffs)
        for conn in self._ranks.conns:
            conn.send(("serve", None))
        self._reader = threading.Thread(target=self._read, name="shardlm-events", daemon=True)
        self._reader.start()

    # ---- requests ------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.error is None

    def room(self, prompt_len: int) -> tuple[int, str]:
        """Most new tokens a prompt of this length may ask for, and what bounds it (for messages):
        the context, or the KV cache (a request's last token needs no KV slot)."""
        slots = self.kv_tokens
        if self.max_model_len <= slots + 1:
            return self.max_model_len - prompt_len, f"the context {self.max_model_len}"
        return slots + 1 - prompt_len, f"the KV cache {slots} tokens (--kv-cache-memory, or more --cp ranks)"

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Refuse a request that cannot be served, with a message for the client (HTTP 400)."""
        if not prompt_ids:
            raise UsageError("the prompt is empty; give at least one token")
        room, why = self.room(len(prompt_ids))
        if room < 1:
            raise UsageError(
                f"the prompt has {len(prompt_ids)} tokens but {why} leaves no room for an answer; shorten the prompt"
            )
        if params.max_tokens > room:
            raise UsageError(
                f"max_tokens={params.max_tokens} does not fit: the prompt has {len(prompt_ids)} tokens "
                f"and {why}; lower max_tokens to {room} or less"
            )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[StreamOutput]:
        """Stream the completions of one prompt (``params.n`` of them, told apart by
        ``StreamOutput.index``). Leaving the loop early cancels the request."""
        async for out in self.generate_choices([prompt_ids], params):
            yield out

    async def generate_choices(self, prompts: list[list[int]], params: SamplingParams) -> AsyncIterator[StreamOutput]:
        """Stream ``params.n`` completions of each prompt, interleaved as they come: completion j of
        prompt i has ``index`` i * n + j (OpenAI's numbering). A prompt's n completions go to one
        replica, where the later ones find the prompt in the prefix cache (``Request.after``); their
        seeds are ``params.seed`` + j. Leaving the loop early cancels whatever has not finished."""
        if self.error is not None:
            raise EngineDead(self.error)
        self.check_params(params)
        for ids in prompts:
            self.check(ids, params)
        if params.generated > params.n:
            raise UsageError(
                f"best_of={params.best_of}: AsyncLLM streams every completion; ask for n={params.best_of} "
                "and keep the best yourself (/v1/completions does)"
            )
        n = params.n
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        adds = []
        with self._lock:
            if len(self._streams) + n * len(prompts) > self.max_queue:
                raise QueueFull(f"{len(self._streams)} requests are in flight (max_queue={self.max_queue})")
            rids = []
            for i, ids in enumerate(prompts):
                replica = min(self._prefill, key=self._load.__getitem__)
                handoff = min(self._decode, key=self._load.__getitem__) if self._decode is not None else None
                first = None
                for j in range(n):
                    rid = next(self._ids)
                    rids.append(rid)
                    work = {replica: len(ids) + params.max_tokens}
                    if handoff is not None:  # the prefill replica computes the prompt only
                        work = {replica: len(ids), handoff: len(ids) + params.max_tokens}
                    for r, w in work.items():
                        self._load[r] += w
                    self._streams[rid] = _Stream(queue, loop, replica, work, i * n + j)
                    seed = params.seed + j if params.seed is not None else self.config.seed + rid
                    adds.append((replica, (rid, Request(list(ids), params, seed, handoff, after=first))))
                    first = rid if first is None else first
        finished: set[int] = set()
        try:
            for replica, add in adds:
                self._send(replica, ("add", add))
            while len(finished) < len(rids):
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield item
                if item.finish_reason is not None:
                    finished.add(item.index)
        finally:
            with self._lock:  # with the reader's handoffs: the abort goes where the request is now
                for rid in rids:
                    stream = self._streams.pop(rid)
                    for r, w in stream.work.items():
                        self._load[r] -= w
                    if stream.index not in finished and self.error is None:
                        self._send_locked(stream.replica, ("abort", rid))  # client went away: free its blocks

    def _send(self, replica: int, message) -> None:
        with self._lock:
            self._send_locked(replica, message)

    def _send_locked(self, replica: int, message) -> None:
        """To a replica's leader; a closed pipe means the rank is gone (the reader reports which)."""
        try:
            self._ranks.conns[self._replica_leaders[replica]].send(message)
        except OSError as e:
            raise EngineDead(self.error or f"replica {replica}'s leader rank cannot be reached ({e})") from None

    # ---- events from the ranks -------------------------------------------------------------
    def _read(self) -> None:
        conns = self._ranks.conns
        try:
            while True:
                for conn in readable(conns):
                    rank = conns.index(conn)
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        raise RankFailure(self._ranks.died(rank)) from None
                    if kind in ("error", "lost"):
                        raise RankFailure(self._ranks.cause(rank, kind, value))
                    if kind == "done":  # the serving loop ended (after stop)
                        return
                    if kind == "events":
                        self._dispatch(self._replica_leaders.index(rank), *value)
        except (RankFailure, EngineDead) as e:
            self._fail(str(e))
        except Exception as e:
            self._fail(f"the driver's event reader failed: {e!r}")
            raise

    def _dispatch(self, replica: int, tokens, finished, stats, handoffs, scored) -> None:
        self._replica_stats[replica] = stats
        numbers = {k: sum(s[k] for s in self._replica_stats) for k, v in stats.items() if k != "expert_load"}
        self.stats = {
            **numbers,
            "expert_load": merge_expert_loads([s.get("expert_load") for s in self._replica_stats]),
            **self._handoffs,
        }
        outs: dict[int, StreamOutput] = {}
        for rid, entries in scored:  # before the tokens: a prompt is scored by the step that samples after it
            outs.setdefault(rid, StreamOutput([])).prompt_logprobs += entries
        for rid, tok, logprob in tokens:
            out = outs.setdefault(rid, StreamOutput([]))
            out.token_ids.append(tok)
            if logprob is not None:
                out.logprobs.append(logprob)
        for rid, reason, cached, stop_reason, queue_s in finished:
            out = outs.setdefault(rid, StreamOutput([]))
            out.finish_reason, out.cached_tokens, out.stop_reason, out.queue_s = reason, cached, stop_reason, queue_s
        with self._lock:
            targets = [(self._streams.get(rid), out) for rid, out in outs.items()]
        for stream, out in targets:
            if stream is not None:
                out.index = stream.index
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
        for h in handoffs:  # after the first token above
            self._forward(h)

    def _forward(self, h: Handoff) -> None:
        """Send a prefilled request on to its decode replica, which must receive its KV even when
        the client has gone (its ranks' sends are under way): then it is aborted there at once."""
        self._handoffs["kv_handoffs"] += 1
        self._handoffs["kv_transfer_bytes"] += h.num_blocks * self._block_bytes[h.src]
        with self._lock:
            stream = self._streams.get(h.rid)
            self._send_locked(h.dst, ("adopt", h))
            if stream is None:
                self._send_locked(h.dst, ("abort", h.rid))
            else:
                stream.replica = h.dst
                self._load[h.src] -= stream.work.pop(h.src)

    def _fail(self, message: str) -> None:
        self.error = message
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, EngineDead(message))

    def shutdown(self) -> None:
        """Stop serving and every rank (in-flight requests end with EngineDead)."""
        if self.error is None:
            for replica in range(len(self._replica_leaders)):
                try:
                    self._send(replica, ("stop", None))  # under the lock: the reader forwards handoffs
                except EngineDead:
                    pass
            self._reader.join(timeout=10)
            self._fail("the server is shutting down")
        self._ranks.close()


def merge_expert_loads(loads: list[dict | None]) -> dict | None:
    """One MoE load report from the replicas' (each counts its own tokens unless it already
    covers all replicas): tokens per expert and per ep rank, and max/mean per layer."""
    given = [x for x in loads if x is not None]
    if not given:
        return None
    if given[0]["all_replicas"]:
        return given[0]
    add = lambda key: [[sum(col) for col in zip(*layers)] for layers in zip(*(x[key] for x in given))]
    ranks = add("rank_tokens")
    return {
        "expert_tokens": add("expert_tokens"),
        "rank_tokens": ranks,
        "imbalance": [round(imbalance(r), 4) for r in ranks],
        "comm_s": max(x["comm_s"] for x in given),
        "all_replicas": True,
    }

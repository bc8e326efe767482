"""A request's state as the scheduler and runner see it."""

from __future__ import annotations

import enum
import time

import torch

from shardlm.engine.sampling import SamplingParams, TokenLogprob
from shardlm.engine.structured import Guide
from shardlm.engine.text import StopText


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt and generated tokens, the KV blocks that hold them, and timing."""

    def __init__(
        self,
        seq_id: int,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        eos_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        handoff: int | None = None,
        stop_text: StopText | None = None,
    ):
        self.id = seq_id
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per output token when params.logprobs is set
        self.prompt_logprobs: list[TokenLogprob] = []  # prompt tokens 1, 2, ... (params.prompt_logprobs)
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(eos_ids))
        self.generator = generator
        self.handoff = handoff  # disaggregated serving: the decode replica it goes to once prefilled
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache names of its full blocks, in order
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.num_cached = 0  # of the prompt, tokens found in the prefix cache
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # vLLM's: the stop token id or string (None: EOS, or length)
        self.stop_text = stop_text  # the text so far, when params.stop lists strings
        self.guide: Guide | None = None  # structured outputs: the grammar state, on the ranks that sample
        # speculative decoding with a draft model (draft.py): the drafts for its next step (every rank),
        # and on the sampling ranks the distributions they were drawn from ([drafts, vocab]; None:
        # greedy), the tokens whose K/V the draft's cache holds, and the draft's own generator
        self.proposed: list[int] = []
        self.draft_q: torch.Tensor | None = None
        self.draft_computed = 0
        self.draft_generator: torch.Generator | None = None
        self.arrival = time.perf_counter()
        self.scheduled_time: float | None = None  # first admitted to a batch (queue time: from arrival)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) without copying the whole history."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def append(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Record a sampled token (and its logprobs) and decide whether the sequence is done."""
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.append(token)
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.guide is not None:
            self.guide.advance(token)
        if token in self.stop_ids:
            self.finish("stop")
            self.stop_reason = token if token in self.params.stop_token_ids else None
            return
        if self.stop_text is not None:
            self.stop_text.push([token])
            if self.stop_text.stopped:
                self.finish("stop")
                self.stop_reason = self.stop_text.stopped
                return
        if len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens still need their logprobs (so the prompt may not come from the cache)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is in the cache: the next step feeds one token."""
        return self.num_computed == self.num_tokens - 1

    def finish(self, reason: str) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

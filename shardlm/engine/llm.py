"""The Python API: ``LLM(model, tp=...)`` and ``llm.generate(prompts, SamplingParams(...))``.

A one-rank layout runs in the calling process. A multi-rank layout started from
a plain Python process spawns its ranks on this host (``LocalRanks``) and the
caller becomes their driver. Under torchrun every process is a rank: each runs the
same script and calls ``generate`` with the same prompts (SPMD).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from shardlm.engine.config import EngineConfig
from shardlm.engine.draft import check_draft
from shardlm.engine.engine import Request, RunStats
from shardlm.engine.sampling import SamplingParams
from shardlm.engine.structured import check_grammar
from shardlm.engine.text import StopText
from shardlm.engine.worker import Completion, Worker, max_model_len
from shardlm.errors import ClosedError, UsageError
from shardlm.launch import JoinedRanks, LocalRanks, holds_group, resolve_device, torchrun_env
from shardlm.models.loader import Checkpoint, open_checkpoint
from shardlm.models.moe import check_expert_layout
from shardlm.parallel.data import gather_replicas
from shardlm.parallel.dims import ParallelDims
from shardlm.parallel.expert import experts_span_replicas
from shardlm.parallel.pipeline import stage_layers
from shardlm.parallel.tensor import partition_heads

Prompt = str | list[int]


@dataclass
class Logprob:
    """vLLM's: a token's log-probability, its rank (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's ``RequestOutput.outputs[i]``."""

    index: int
    text: str | None  # None for prompts given as token ids
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of the tokens' logprobs, when logprobs were asked for
    logprobs: list[dict[int, Logprob]] | None  # per token: it and the top ``logprobs`` tokens
    finish_reason: str | None  # "stop" or "length" once finished (vLLM: None while running)
    stop_reason: int | str | None = None  # the stop token id or string that ended it (None: EOS or length)


@dataclass
class RequestOutput:
    """A prompt and its ``n`` completions (``outputs``); ``text``, ``token_ids`` and
    ``finish_reason`` are short for the first one's."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    """With ``prompt_logprobs``: per prompt token, it and the top k at its position (None for the first)."""

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def best(done: list[Completion], p: SamplingParams) -> list[Completion]:
    """best_of: the ``p.n`` completions with the highest cumulative logprob (logprobs dropped again
    unless ``p`` asked for them)."""
    ranked = sorted(done, key=lambda c: -sum(e.logprob for e in c.logprobs or []))[: p.n]
    return ranked if p.logprobs is not None else [dataclasses.replace(c, logprobs=None) for c in ranked]


GENERATION_DEFAULTS = {  # generation_config.json's name -> SamplingParams' (the fields vLLM takes from it)
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(generation_config: str, ckpt: Checkpoint) -> dict:
    """Default sampling fields from ``generation_config.json`` (vLLM's ``--generation-config``):
    'auto' reads the model directory's, 'vllm' none, any other value names a directory holding one."""
    if generation_config == "vllm":
        return {}
    folder = ckpt.path if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not (folder / "generation_config.json").is_file():
        raise UsageError(
            f"generation_config={generation_config!r}: no generation_config.json there; give 'auto' (the "
            f"model's), 'vllm' (none) or a directory that holds one"
        )
    file = folder / "generation_config.json"
    if not folder.is_dir() or not file.is_file():
        return {}  # a GGUF file, or a directory without one
    given = json.loads(file.read_text())
    return {ours: given[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if given.get(theirs) is not None}


def settle(config: EngineConfig, ckpt: Checkpoint) -> EngineConfig:
    """``config`` for this model on the device its ranks will pick (each host's alike): dtype
    'auto' and enable_expert_parallel settled (EngineConfig.for_model)."""
    env = torchrun_env()
    local_world = env["local_world"] if env is not None else config.dims().world_size
    return config.for_model(ckpt.config, resolve_device(config.device, local_world))


def check_layout(config: EngineConfig, ckpt: Checkpoint) -> ParallelDims:
    """Reject a layout the model cannot take, before any rank starts."""
    dims = config.dims()
    ckpt.config.check_supported()
    partition_heads(ckpt.config.num_heads, ckpt.config.num_kv_heads, dims.tp, 0)
    check_expert_layout(ckpt.config, dims.ep, dims.etp)
    stage_layers(ckpt.config, dims.pp, config.pp_layers)
    check_draft(
        config.speculative_config,
        ckpt,
        dims.tp,
        max_model_len(config, ckpt.config.max_position_embeddings),
    )
    if config.prefill_replicas and ckpt.config.is_moe and experts_span_replicas(dims.tp, dims.ep, dims.etp):
        raise UsageError(
            f"prefill_replicas={config.prefill_replicas} needs replicas that step on their own, but "
            f"experts over ep*etp={dims.ep * dims.etp} ranks (not dividing tp={dims.tp}) keep "
            f"the replicas in lockstep; use ep*etp dividing tp, or no prefill replicas"
        )
    if config.compile and ckpt.config.is_moe:
        raise UsageError(
            f"compile=True supports dense models; {ckpt.path.name} is a mixture of experts, whose "
            "routing torch.compile cannot trace: drop --compile"
        )
    return dims


class EngineFront:
    """What ``LLM`` and ``AsyncLLM`` share: the checkpoint, its checked layout, the context
    length, and the tokenizer (loaded on first use: token-id callers never need it)."""

    _ranks: LocalRanks | None = None  # the rank processes this front started (None: it runs in them)

    def __init__(self, model: str | Checkpoint, options: dict, tokenizer=None):
        self.chat_template: str | None = options.pop("chat_template", None)  # overrides the model's
        generation_config = options.pop("generation_config", "auto")
        ckpt = model if isinstance(model, Checkpoint) else open_checkpoint(model)
        self.config = settle(EngineConfig.of(model=str(ckpt.path), **options), ckpt)
        self.checkpoint = ckpt
        self.dims = check_layout(self.config, ckpt)
        self.max_model_len = max_model_len(self.config, ckpt.config.max_position_embeddings)
        self.sampling_defaults = sampling_defaults(generation_config, ckpt)
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        if self.chat_template is not None:
            self._tokenizer.chat_template = self.chat_template
        return self._tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: SamplingParams with the model's generation_config.json defaults (``generation_config``)."""
        return SamplingParams(**self.sampling_defaults)

    def check_params(self, p: SamplingParams) -> None:
        """Refuse sampling params this model or layout cannot honour, before any rank sees them."""
        vocab = self.checkpoint.config.vocab_size
        if bad := [t for t in (*p.logit_bias, *p.stop_token_ids) if t >= vocab]:
            raise UsageError(f"token id {bad[0]} (logit_bias or stop_token_ids) is outside the vocabulary [0, {vocab})")
        if p.structured_outputs is not None:
            if self.config.speculative_config is not None:
                raise UsageError(
                    "structured outputs do not run with speculative decoding yet (drafts are not checked "
                    "against the grammar); drop speculative_config or the structured output"
                )
            check_grammar(p.structured_outputs, self.tokenizer, vocab)

    def _spawn_ranks(self) -> list[dict]:
        """Start every rank as a child process on this host, or under torchrun drive its ranks from
        this process (global rank 0's: rank 0's worker becomes its child); their ``ready`` infos, in
        rank order."""
        env = torchrun_env()
        if env is not None:
            self.dims.check_world_size(env["world"])
        kind, make = (JoinedRanks, Worker.joined) if env is not None else (LocalRanks, Worker.spawned)
        ranks = kind(self.dims.world_size, make, (self.config,), timeout_s=self.config.timeout_s)
        try:
            infos = ranks.collect("ready")
        except BaseException:
            ranks.close()
            raise
        self._ranks = ranks
        return infos

    def param_mib(self) -> str:
        """Each rank's parameters in MiB, for the load line (and those in CPU memory, if any)."""
        mib = ", ".join(f"{b / 2**20:.1f}" for b in self.param_bytes)
        if any(self.offloaded_bytes):
            mib += " (in CPU memory: " + ", ".join(f"{b / 2**20:.1f}" for b in self.offloaded_bytes) + ")"
        return mib

    def _took_ready(self, infos: list[dict]) -> None:
        self.param_bytes = [i["param_bytes"] for i in infos]
        self.offloaded_bytes = [i["offloaded_bytes"] for i in infos]  # of param_bytes, in CPU memory (cpu_offload_gb)
        self.kv_blocks = infos[0]["kv_blocks"]  # a block under cp is one on each of the replica's cp ranks
        self.kv_tokens = self.kv_blocks * self.config.block_size * self.dims.cp
        """Tokens one replica's KV cache holds (its cp ranks together)."""
        # the first rank of each replica speaks for it (all its ranks hold the same results)
        self._replica_leaders = [
            r for r, i in enumerate(infos) if i["coords"]["pp"] == i["coords"]["cp"] == i["coords"]["tp"] == 0
        ]


class LLM(EngineFront):
    def __init__(self, model: str | Checkpoint = "smollm2", *, tokenizer=None, **options):
        super().__init__(model, options, tokenizer)
        if self.config.prefill_replicas:
            raise UsageError(
                f"prefill_replicas={self.config.prefill_replicas} is a serving layout (requests that "
                "arrive over time); use AsyncLLM or `shardlm serve --prefill-replicas`, or 0 here"
            )
        self.last_stats: RunStats | None = None
        self.last_rank_stats: list[RunStats] = []  # every rank's own, for runs this process drives
        self.last_replica_stats: list[RunStats] = []  # each dp replica's, in replica order
        start = time.perf_counter()
        env = torchrun_env()
        self.worker: Worker | None = None
        if env is None and self.dims.world_size > 1:
            infos = self._spawn_ranks()
        else:
            if env is not None:
                self.dims.check_world_size(env["world"])
            rank = env or {"rank": 0, "world": 1, "local_rank": 0, "local_world": 1}
            self.worker = Worker(
                self.config,
                rank=rank["rank"],
                world=rank["world"],
                local_rank=rank["local_rank"],
                local_world=rank["local_world"],
                init_method="env://" if env else None,
            )
            infos = [self.worker.ready_info()]
            holds_group(self)
        self.load_s = time.perf_counter() - start
        self._took_ready(infos)
        stages = sorted(
            (i["coords"]["pp"], r)
            for r, i in enumerate(infos)
            if i["coords"]["dp"] == i["coords"]["cp"] == i["coords"]["tp"] == 0
        )
        self._stage_leaders = [r for _, r in stages]  # replica 0's cp- and tp-rank-0 of each stage, in pp order

    # ---- prompts -------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's ids (text is encoded as the model's tokenizer does, special tokens added)."""
        return self._fits(self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template) -> list[int]:
        """A conversation's ids: its chat template rendered and encoded as HF's
        ``apply_chat_template(..., tokenize=True)`` does (``Tokenizer.encode_chat``); ``template``:
        ``chat_template`` (instead of the model's) and the template's variables."""
        self.chat_prompt(messages, add_generation_prompt, **template)  # says so when there is no template
        return self._fits(self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **template))

    def _fits(self, ids: list[int]) -> list[int]:
        if not ids:
            raise UsageError("an empty prompt has no token to continue from; give at least one token")
        if len(ids) >= self.max_model_len:
            raise UsageError(
                f"prompt of {len(ids)} tokens does not fit the context of {self.max_model_len} tokens "
                f"(max_model_len); shorten it or raise max_model_len (the model allows "
                f"{self.checkpoint.config.max_position_embeddings})"
            )
        return ids

    def check_kv(self, prompt_len: int, max_tokens: int) -> None:
        """Refuse a request whose KV cache one replica cannot hold, suggesting enough cp ranks."""
        need = prompt_len + max_tokens - 1  # the last token sampled needs no slot
        if need <= self.kv_tokens:
            return
        per_rank = self.kv_tokens // self.dims.cp
        cp = -(-need // per_rank)
        raise UsageError(
            f"a prompt of {prompt_len} tokens with max_tokens={max_tokens} needs {need} KV-cache slots, but a "
            f"replica holds {self.kv_tokens} ({per_rank} per rank at cp={self.dims.cp}); stripe it over cp={cp} "
            f"ranks (--cp {cp}), raise kv_cache_memory, or lower max_tokens"
        )

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, **template) -> str:
        if not (template.get("chat_template") or self.tokenizer.chat_template):
            raise UsageError(
                f"model {self.config.model!r} has no chat template; pass raw prompts, or chat_template=..."
            )
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, **template)

    # ---- generation ----------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Complete each prompt (text or token ids). ``on_token(i, token_id)`` streams on this rank."""
        one = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int))
        items = cast("list[Prompt]", [prompts] if one else list(prompts))
        return self._generate(items, [self.encode(p) for p in items], params, on_token)

    def _generate(self, prompts: list, prompt_ids: list[list[int]], params, on_token) -> list[RequestOutput]:
        params = params or self.get_default_sampling_params()
        param_list: list[SamplingParams] = (
            list(params) if isinstance(params, (list, tuple)) else [cast(SamplingParams, params)] * len(prompts)
        )
        if len(param_list) != len(prompts):
            raise UsageError(f"{len(param_list)} sampling params for {len(prompts)} prompts; give one or one each")
        requests: list[Request] = []
        for ids, p in zip(prompt_ids, param_list):
            self.check_params(p)
            room = self.max_model_len - len(ids)
            if p.max_tokens > room:
                p = dataclasses.replace(p, max_tokens=room)  # stops at the context end ("length")
            self.check_kv(len(ids), p.max_tokens)
            first = len(requests)
            for j in range(p.generated):  # n choices: seeds seed, seed + 1, ...; the first computes the prompt
                seed = p.seed + j if p.seed is not None else self.config.seed + len(requests)
                requests.append(Request(ids, p.for_engine(), seed, after=first if j else None))
        completions = iter(self._run(requests, on_token))
        outputs = []
        for pr, ids, p in zip(prompts, prompt_ids, param_list):
            text = isinstance(pr, str)  # prompts given as token ids get token ids back
            done = [next(completions) for _ in range(p.generated)]
            scored = done[0].prompt_logprobs
            if p.generated > p.n:  # best_of: the n most likely, most likely first
                done = best(done, p)
            outputs.append(
                RequestOutput(
                    prompt=pr if text else None,
                    prompt_token_ids=ids,
                    outputs=[self._choice(j, c, p, text) for j, c in enumerate(done)],
                    prompt_logprobs=None if scored is None else [None, *self._logprob_dicts(ids[1:], scored, text)],
                )
            )
        return outputs

    def _choice(self, index: int, c: Completion, p: SamplingParams, text: bool) -> CompletionOutput:
        decoded = None
        if text:
            if p.stop:  # cut before the stop string, as the engine saw it
                st = StopText(self.tokenizer, p.stop)
                decoded = st.push(c.token_ids) + st.flush()
            else:
                decoded = self.tokenizer.decode(c.token_ids)
        logprobs = None if c.logprobs is None else self._logprob_dicts(c.token_ids, c.logprobs, text)
        return CompletionOutput(
            index=index,
            text=decoded,
            token_ids=c.token_ids,
            cumulative_logprob=sum(e.logprob for e in c.logprobs) if c.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )

    def _logprob_dicts(self, tokens: list[int], entries: list, text: bool) -> list[dict[int, Logprob]]:
        """vLLM's per-token dicts: the token and the top k, each with its rank (and text for text prompts)."""
        name = (lambda t: self.tokenizer.decode([t])) if text else (lambda t: None)
        return [
            {t: Logprob(e.logprob, e.rank, name(t)), **{i: Logprob(v, r, name(i)) for r, (i, v) in enumerate(e.top, 1)}}
            for t, e in zip(tokens, entries)
        ]

    def chat(
        self,
        conversations: list[dict] | list[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_token: Callable[[int, int], None] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Complete each conversation (a list of messages) after its chat template's generation
        prompt (vLLM's keywords: another ``chat_template``, variables for it, no generation prompt)."""
        convs = cast(
            "list[list[dict]]",
            [conversations] if conversations and isinstance(conversations[0], dict) else conversations,
        )
        template = {**(chat_template_kwargs or {}), **({"chat_template": chat_template} if chat_template else {})}
        # the ids, not the rendered text encoded again: its BOS is in it already
        ids = [self.encode_chat(c, add_generation_prompt, **template) for c in convs]
        texts = [self.chat_prompt(c, add_generation_prompt, **template) for c in convs]
        return self._generate(texts, ids, params, on_token)

    def _run(self, requests: list[Request], on_token) -> list[Completion]:
        if self._ranks is None:  # one process, or torchrun: gather the replicas' results once
            if self.worker is None:
                raise ClosedError("this LLM is closed (close() or the end of its with block); build another")
            mine = self.worker.generate(requests, on_token)
            per_replica = gather_replicas(mine, self.worker.dims)
            self.last_rank_stats = [mine[1]]
        else:
            try:
                results = self._ranks.call("generate", requests, on_token=on_token)
            except BaseException:
                self.close()  # a failed run cannot be resumed: its ranks may be stuck in a collective
                raise
            per_replica = [results[r] for r in self._replica_leaders]
            self.last_rank_stats = [stats for _, stats in results]
        done: dict[int, Completion] = {}
        for completions, _ in per_replica:  # replicas served disjoint requests
            done.update(completions)
        self.last_replica_stats = [stats for _, stats in per_replica]
        self.last_stats = merge_stats(self.last_replica_stats)
        if self._ranks is not None and self.last_stats.expert_load is not None:
            self.last_stats.expert_load = join_stages(
                [self.last_rank_stats[r].expert_load for r in self._stage_leaders]
            )
        return [done[i] for i in range(len(requests))]

    def close(self) -> None:
        """Stop the ranks this LLM started, or let go of this process's model and mesh."""
        if self._ranks is not None:
            self._ranks.close()
            self._ranks = None
        self.worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def merge_stats(parts: list[RunStats]) -> RunStats:
    """One run's timing from its replicas': they ran side by side, so token counts add up."""
    first = [p.first_token_s for p in parts if p.first_token_s is not None]
    return RunStats(
        elapsed_s=max(p.elapsed_s for p in parts),
        first_token_s=min(first) if first else None,
        prompt_tokens=sum(p.prompt_tokens for p in parts),
        generated_tokens=sum(p.generated_tokens for p in parts),
        decode_s=max(p.decode_s for p in parts),
        decode_tokens=sum(p.decode_tokens for p in parts),
        draft_tokens=sum(p.draft_tokens for p in parts),
        accepted_tokens=sum(p.accepted_tokens for p in parts),
        expert_load=parts[0].expert_load,
    )  # already summed over the stage's dp x tp ranks


def join_stages(loads: list[dict | None]) -> dict:
    """Expert load of the whole model from its pipeline stages' (layer lists in pp order; a stage
    without MoE layers reports None)."""
    given = [load for load in loads if load is not None]
    out: dict = {k: [x for load in given for x in load[k]] for k in ("expert_tokens", "rank_tokens", "imbalance")}
    out["comm_s"] = max(load["comm_s"] for load in given)
    return out

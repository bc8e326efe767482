"""One rank of a run: its place on the mesh, its shard of the model, its engine."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardlm.engine.block_manager import BlockManager
from shardlm.engine.config import EngineConfig, kv_budget
from shardlm.engine.draft import Drafter, load_draft
from shardlm.engine.engine import Engine, Request, RunStats
from shardlm.engine.model_runner import ModelRunner
from shardlm.engine.offload import GIB, WeightOffload
from shardlm.engine.sampling import SamplingParams, TokenLogprob
from shardlm.engine.scheduler import Batch, SchedulerConfig
from shardlm.engine.sequence import Sequence
from shardlm.engine.speculative import SpeculativeConfig
from shardlm.launch import (
    join_driver,
    obey,
    share_driver,
    start_rank,
    torchrun_env,
)
from shardlm.models.loader import load_model, open_checkpoint
from shardlm.models.moe import moe_blocks, needs_lockstep
from shardlm.parallel.data import ReplicaLink, assign
from shardlm.parallel.expert_stats import collect_load
from shardlm.parallel.pipeline import StageLinks, stage_layers
from shardlm.parallel.tensor import quantize_int8


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    finish_reason: str | None  # set on every sequence a run returns (it finished or was aborted)
    logprobs: list[TokenLogprob] | None = None  # one per token, when its params asked for logprobs
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1, 2, ... when asked for


def max_model_len(config: EngineConfig, max_positions: int) -> int:
    return min(config.max_model_len or max_positions, max_positions)


def replica_of(requests: list[Request], dp: int) -> list[int]:
    """The replica serving each request: least outstanding work (prompt + requested tokens); a
    request ``after`` a sibling goes where it goes (to find its prompt in that replica's cache)."""
    out = assign([len(r.prompt_ids) + r.params.max_tokens for r in requests], dp)
    return [out[r.after] if r.after is not None else d for r, d in zip(requests, out)]


class Worker:
    def __init__(
        self, config: EngineConfig, *, rank: int, world: int, local_rank: int, local_world: int, init_method: str | None
    ):
        self.rank = rank
        self.device = start_rank(
            config.device, config.threads, rank=rank, world=world, local_rank=local_rank, local_world=local_world,
            init_method=init_method, timeout_s=config.timeout_s,
        )  # fmt: skip
        device_type = self.device.type
        self.checkpoint = ckpt = open_checkpoint(config.model)
        config = config.for_model(ckpt.config, device_type)
        self.dims = config.dims().build_mesh(device_type)
        self.config = config
        self.max_model_len = max_model_len(config, ckpt.config.max_position_embeddings)
        self.layers = stage_layers(ckpt.config, self.dims.pp, config.pp_layers)[self.dims.pp_rank]
        start = time.perf_counter()
        offload = int(config.cpu_offload_gb * GIB)  # for_model refused it off a GPU
        self.model = load_model(
            ckpt,
            self.dims,
            dtype=config.torch_dtype,
            device="cpu" if offload else self.device,  # the offloaded layers never pass through the GPU whole
            max_positions=self.max_model_len,
            layers=self.layers,
            int4=config.quantization if config.quantization in ("int4", "gguf") else None,
        )
        prepare = quantize_int8 if config.quantization == "int8" else None
        self.offload = WeightOffload(self.model, self.device, offload, prepare) if offload else None
        if prepare is not None and self.offload is None:
            prepare(self.model)
        self.load_s = time.perf_counter() - start
        bs, cp = config.block_size, self.dims.cp
        self.kv_block_bytes = per_block = ModelRunner.kv_bytes_per_block(self.model, bs, config.kv_torch_dtype)
        # under cp a block of the block manager is one block on each cp rank: cp x bs tokens
        needed = -(-config.max_num_seqs * self.max_model_len // (bs * cp))  # more could never be used
        budget = config.kv_cache_memory
        if config.gpu_memory_utilization is not None:  # for_model refused it off a GPU
            budget = kv_budget(config.gpu_memory_utilization, *torch.cuda.mem_get_info(self.device))
            if self.offload is not None:  # two offloaded layers are on the GPU at once during a step
                budget -= 2 * self.offload.largest_layer
        self.num_blocks = max(1, min(budget // max(per_block, 1), needed))
        self.moe = bool(moe_blocks(self.model))
        # graphs on a GPU; tp > 1 stays eager: capturing NCCL calls never ran here (one GPU lent)
        graphs = (
            device_type == "cuda"
            and not config.enforce_eager
            and self.dims.tp == cp == 1
            and not self.moe
            and not offload
        )
        self.runner = ModelRunner(
            self.model,
            num_blocks=self.num_blocks,
            block_size=bs,
            device=self.device,
            dtype=config.torch_dtype,
            kv_dtype=config.kv_torch_dtype,
            compile=config.compile,
            cuda_graphs=graphs,
            max_num_seqs=config.max_num_seqs,
            announce=rank == 0,
            cp_group=self.dims.cp_group,
            cp_attention=config.cp_attention,
        )
        spec = SpeculativeConfig.of(config.speculative_config)
        drafts = spec.num_speculative_tokens if spec is not None and spec.drafts_with_model else 0
        self.drafter = None
        # the sampling ranks draft (draft.py); built after quantization, whose layers layer_skip shares
        if spec is not None and drafts and self.model.last:
            draft = load_draft(
                spec,
                self.model,
                ckpt,
                self.dims,
                config.quantization,
                dtype=config.torch_dtype,
                device=self.device,
                max_positions=self.max_model_len,
            )
            self.drafter = Drafter(
                draft,
                k=drafts,
                num_blocks=self.num_blocks,
                block_size=bs,
                device=self.device,
                dtype=config.torch_dtype,
                kv_dtype=config.kv_torch_dtype,
                max_num_seqs=config.max_num_seqs,
            )
        self.engine = Engine(
            self.runner,
            BlockManager(self.num_blocks, bs * cp),
            eos_ids=ckpt.config.eos_token_ids,
            config=SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                speculative=spec,
            ),
            links=StageLinks(self.dims),
            micro_batches=config.micro_batches or self.dims.pp,
            lockstep=self.dims.dp_group if self.dims.dp > 1 and needs_lockstep(self.model) else None,
            replica_link=ReplicaLink(self.dims, config.prefill_replicas, self.device)
            if config.prefill_replicas
            else None,
            tokenizer=ckpt.tokenizer,
            draft_slots=drafts,
            drafter=self.drafter,
        )

    @classmethod
    def spawned(cls, rank: int, world: int, init_method: str, config: EngineConfig) -> Worker:
        """Entry for ranks that LocalRanks starts on this host (local rank = global rank)."""
        return cls(config, rank=rank, world=world, local_rank=rank, local_world=world, init_method=init_method)

    @classmethod
    def from_torchrun(cls, config: EngineConfig) -> Worker:
        """This torchrun process's rank (its place from torchrun's environment)."""
        env = torchrun_env()
        assert env is not None  # called under torchrun only
        return cls(
            config,
            rank=env["rank"],
            world=env["world"],
            local_rank=env["local_rank"],
            local_world=env["local_world"],
            init_method="env://",
        )

    @classmethod
    def joined(cls, rank: int, world: int, init_method: str, config: EngineConfig, driver) -> Worker:
        """Entry for global rank 0 of a torchrun server, started by the driver in torchrun's rank 0
        process (launch.JoinedRanks): it tells the other ranks where the driver listens."""
        worker = cls.from_torchrun(config)
        share_driver(driver)
        return worker

    def ready_info(self) -> dict:
        return {
            "param_bytes": self.model.param_bytes(),
            "offloaded_bytes": self.offload.bytes if self.offload else 0,
            "load_s": self.load_s,
            "kv_blocks": self.num_blocks,
            "kv_block_bytes": self.kv_block_bytes,
            "layers": (self.layers.start, self.layers.stop),
            "coords": self.dims.coords(self.dims.global_rank),
        }

    def prompt_logits(self, prompt_ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Logits [len(prompt_ids), vocab] at every position of one prompt (one-stage layouts;
        for tests and scoring). ``chunk``: feed this many tokens a step, so that each step reads
        the earlier tokens' keys and values back from the KV cache, as decoding does."""
        seq = Sequence(-1, prompt_ids, SamplingParams(temperature=0.0, max_tokens=1))
        blocks = self.engine.blocks
        blocks.grow(seq, seq.num_tokens)
        out = []
        try:
            while seq.num_computed < seq.num_tokens:
                n = min(chunk or seq.num_tokens, seq.num_tokens - seq.num_computed)
                out.append(self.runner.run(Batch([seq], [n]), all_positions=True))
                seq.num_computed += n
            return torch.cat(out)
        finally:
            blocks.free(seq)

    def serve(self, link) -> None:
        """Serve requests that the driver sends until it says stop (see serve_loop)."""
        from shardlm.engine.serve_loop import serve

        serve(self, link)

    def generate(self, requests: list[Request], on_token=None) -> tuple[dict[int, Completion], RunStats]:
        """Serve this rank's replica's share of ``requests``: {request index: completion}."""
        mine = {
            i: r for i, (r, d) in enumerate(zip(requests, replica_of(requests, self.dims.dp))) if d == self.dims.dp_rank
        }
        seqs, stats = self.engine.run(mine, None if on_token is None else lambda rid, tok, _: on_token(rid, tok))
        if self.moe:  # every rank of the stage, after decoding: one collective over its tp and dp groups
            stats.expert_load = collect_load(self.model, self.dims).to_dict()
        return {
            s.id: Completion(
                s.output_ids,
                s.finish_reason,
                s.logprobs if s.params.logprobs is not None else None,
                s.stop_reason,
                s.prompt_logprobs if s.params.prompt_logprobs is not None else None,
            )
            for s in seqs
        }, stats


def serve_under_torchrun(config: EngineConfig) -> int:
    """A torchrun rank other than global rank 0 of a server: its worker, driven by the server in
    rank 0's process (launch.JoinedRanks) over TCP; the exit code (0: stopped, 3: driver gone)."""
    worker = Worker.from_torchrun(config)
    return obey(join_driver(share_driver(None), worker.rank, config.timeout_s), worker, worker.rank)

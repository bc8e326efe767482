"""What a training run shows while it runs: one line per step (loss, gradient norm, lr, tokens/s,
MFU, memory of the heaviest rank), or on a terminal a progress bar holding the same numbers and an
ETA (rich), with the per-step lines kept for logs and ``--json``.

MFU (model FLOPs utilisation; Chowdhery et al. 2022, "PaLM", https://arxiv.org/abs/2204.02311
App. B): the FLOPs a step's tokens need, 6 per matmul parameter per token plus 12·L·H·Q·T for
attention (torchtitan's count), over the time and the ranks' peak: a GPU's datasheet dense rate
from the planner's catalog; on CPU ranks the matmul rate ``shardlm plan --calibrate`` measured on
this machine, when it has (else the line shows TFLOP/s and no MFU).
"""

from __future__ import annotations

import sys
import time

from shardlm.args import log
from shardlm.models.config import ModelConfig
from shardlm.plan.calibrate import cache_path, machine_spec
from shardlm.plan.hardware import datasheet_flops
from shardlm.plan.shard import active_params

GiB = 2**30


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: forward and backward of every matmul, the embedding lookup excepted."""
    matmul = active_params(cfg) - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_word_embeddings else 1)
    return 6 * matmul + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len


def peak_flops(device: str, dtype: str, ranks: int) -> float | None:
    """Dense matmul FLOP/s of one rank: the catalog GPU whose name ``device`` (torch's device name)
    holds, or this machine's calibration for ``ranks`` CPU ranks; None when unknown."""
    if device != "cpu":
        return datasheet_flops(device, dtype)
    if not cache_path().is_file():
        return None
    return machine_spec(ranks).matmul_flops(dtype)


class StepReport:
    """Formats each step's numbers; drives the progress bar on a terminal."""

    def __init__(self, total: int, first: int, tokens_flops: float, peak: float | None, ranks: int, bar: bool):
        self.total, self.first = total, first
        self.tokens_flops, self.peak, self.ranks = tokens_flops, peak, ranks
        self.start = time.perf_counter()
        self.bar = None
        if bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[numbers]}"),
                console=Console(file=sys.stderr),
                transient=False,
            )
            self.task = self.bar.add_task("train", total=total, completed=first, numbers="")
            self.bar.start()

    def numbers(self, s: dict) -> dict:
        tok_s = s["tokens"] / s["seconds"]
        out = {"tokens_per_s": tok_s, "tflops_per_rank": tok_s * self.tokens_flops / self.ranks / 1e12}
        if self.peak:
            out["mfu"] = out["tflops_per_rank"] * 1e12 / self.peak
        return out

    def line(self, step: int, s: dict) -> str:
        n = self.numbers(s)
        speed = f"MFU {100 * n['mfu']:.1f}%" if "mfu" in n else f"{n['tflops_per_rank']:.3f} TFLOP/s per rank"
        heavy = s["heaviest_rank"]
        return (
            f"step {step}/{self.total}  loss {s['loss']:.4f}  grad norm {s['grad_norm']:.3f}  lr {s['lr']:.2e}  "
            f"{n['tokens_per_s']:.0f} tok/s  {speed}  state {heavy['state_bytes'] / GiB:.2f} GiB, "
            f"peak {heavy['peak_bytes'] / GiB:.2f} GiB (heaviest rank)  {s['seconds']:.2f} s"
        )

    def step(self, step: int, s: dict) -> None:
        if self.bar is None:
            log(self.line(step, s))
            return
        n = self.numbers(s)
        speed = f"MFU {100 * n['mfu']:.1f}%" if "mfu" in n else f"{n['tflops_per_rank']:.3f} TFLOP/s/rank"
        numbers = f"loss {s['loss']:.4f}  lr {s['lr']:.2e}  {n['tokens_per_s']:.0f} tok/s  {speed}"
        self.bar.update(self.task, completed=step, numbers=numbers)

    def note(self, text: str) -> None:
        """A line of its own (an evaluation), above the bar on a terminal."""
        if self.bar is None:
            log(text)
        else:
            self.bar.console.print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()

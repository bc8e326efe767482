"""shardlm train's options that need no ranks: the learning-rate schedule, the --config file, the
step line and progress bar, MFU's FLOP count and peak."""

from __future__ import annotations

import io
import math
import re

import pytest

from harness.cli import main_exit
from shardlm.train.lr import lr_factor


def torchtitan(step: int, warmup: int, total: int, floor: float, kind: str) -> float:
    """torchtitan's linear_warmup_stable_decay (no stable phase), written from its definition."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / (total - warmup)
    decay = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[kind]
    return floor + (1 - floor) * decay


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_lr_schedules_are_torchtitans(kind):
    got = [lr_factor(s, schedule=kind, warmup=3, total=10, floor=0.1) for s in range(10)]
    assert got == pytest.approx([torchtitan(s, 3, 10, 0.1, kind) for s in range(10)], rel=1e-12)
    assert got[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])  # warm-up, then the decay starts at the peak
    assert got[3] > got[6] > got[9] > 0.1  # can fail: it decays, towards the floor
    assert [lr_factor(s, schedule="constant", warmup=2, total=None, floor=0) for s in range(4)] == [1 / 3, 2 / 3, 1, 1]


def test_trainer_steps_with_the_scheduled_lr(tiny):
    """Adam's first update of a weight is lr x g / (|g| + eps), about lr: with a warm-up of 4 steps
    the first step moves weights by lr / 5, the schedule's value, not by lr."""
    import torch

    from shardlm.train.trainer import TrainConfig, Trainer

    batch = torch.randint(0, 251, (2, 9), generator=torch.Generator().manual_seed(0))
    moved = {}
    for warmup in (0, 4):
        t = Trainer(TrainConfig(model=str(tiny("llama").path), lr=1e-3, warmup_steps=warmup, max_grad_norm=None))
        before = torch.cat([u.master.detach().clone() for u in t.zero.units])
        stats = t.step(batch)
        assert stats["lr"] == pytest.approx(1e-3 / (warmup + 1))
        moved[warmup] = (torch.cat([u.master.detach() for u in t.zero.units]) - before).abs().max().item()
    assert moved[0] == pytest.approx(1e-3, rel=1e-2) and moved[4] == pytest.approx(2e-4, rel=1e-2)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(lr_schedule="cosine"), "total_steps=None must be an integer above warmup_steps=0"),
        (dict(lr_schedule="linear", total_steps=5, warmup_steps=5), "above warmup_steps=5"),
        (dict(lr_schedule="step"), "lr_schedule='step' is not a schedule"),
        (dict(lr_min=0.1), "constant' does not decay"),
        (dict(lr_min=1.5, lr_schedule="cosine", total_steps=9), "lr_min=1.5 is a fraction of lr in [0, 1)"),
        (dict(warmup_steps=-1), "warmup_steps=-1 must be a non-negative integer"),
    ],
)
def test_bad_schedules_are_refused(options, message):
    from shardlm.errors import UsageError
    from shardlm.train.trainer import TrainConfig

    with pytest.raises(UsageError, match=re.escape(message)):
        TrainConfig(**options)


def test_config_file_keys_are_flags_and_the_command_line_wins(tmp_path):
    from shardlm.args import with_config_file
    from shardlm.cli import build_parser

    config = tmp_path / "run.toml"
    config.write_text(
        'data = "notes.txt"\nsteps = 50\ntp = 2\nlr-schedule = "cosine"\nwarmup_steps = 5\n'
        "json = true\nlr = 3e-4\ntensor-parallel-size = 2\n"
    )
    parser = build_parser()
    argv = ["train", "--config", str(config), "--steps", "7"]
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    args = with_config_file(parser, train, argv)
    assert (args.data, args.steps, args.tp, args.lr_schedule, args.warmup_steps, args.json, args.lr) == (
        "notes.txt",
        7,
        2,
        "cosine",
        5,
        True,
        3e-4,
    )


@pytest.mark.parametrize(
    "text,message",
    [
        ("lr-shedule = 'cosine'", "unknown key 'lr-shedule'; did you mean 'lr-schedule'?"),
        ("steps = 'many'", "steps = 'many': invalid int value"),
        ("lr-schedule = 'cosin'", "lr-schedule = 'cosin' is not one of constant, linear, cosine"),
        ("json = 1", "json = 1 must be true or false"),
        ("steps = [1, 2]", "must be one value"),
        ("steps = ", "is not TOML"),
    ],
)
def test_config_file_mistakes_are_one_line(tmp_path, capsys, text, message):
    config = tmp_path / "run.toml"
    config.write_text(text + "\n")
    code, err = main_exit(["train", "--config", str(config)], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_step_line_and_progress_bar(monkeypatch):
    from shardlm.train.progress import StepReport

    s = {
        "loss": 2.5, "grad_norm": 0.75, "lr": 1e-4, "tokens": 1000, "seconds": 0.5,
        "heaviest_rank": {"state_bytes": 3 * 2**30, "peak_bytes": 5 * 2**30},
    }  # fmt: skip
    with_peak = StepReport(10, 0, tokens_flops=1e9, peak=8e12, ranks=2, bar=False)
    assert with_peak.numbers(s) == pytest.approx({"tokens_per_s": 2000, "tflops_per_rank": 1.0, "mfu": 0.125})
    line = with_peak.line(3, s)
    assert "step 3/10  loss 2.5000" in line and "MFU 12.5%" in line and "state 3.00 GiB, peak 5.00 GiB" in line
    assert "1.000 TFLOP/s per rank" in StepReport(10, 0, 1e9, None, 2, bar=False).line(3, s)
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    report = StepReport(10, 2, 1e9, 8e12, 2, bar=True)
    report.step(3, s)
    report.close()
    assert "3/10" in err.getvalue() and "loss 2.5000" in err.getvalue() and "MFU 12.5%" in err.getvalue()


def test_flops_per_token_and_peaks(tiny):
    from shardlm.models.loader import open_checkpoint
    from shardlm.plan.hardware import datasheet_flops
    from shardlm.train.progress import flops_per_token

    cfg = open_checkpoint("smollm2").config  # tied embeddings: the LM head's matmul counts, the lookup not
    params = 134_515_008  # SmolLM2-135M
    assert flops_per_token(cfg, 2048) == 6 * params + 12 * 30 * 9 * 64 * 2048
    assert datasheet_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert datasheet_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert datasheet_flops("NVIDIA GeForce RTX 4090", "bfloat16") is None


def test_moe_training_refuses_what_it_cannot_do(tmp_path_factory):
    """The load-balancing loss needs the whole batch in one forward; DeepSeek trains without one, in
    float32, and without cp (multi-head latent attention)."""
    from harness.moe_reference import cached_tiny_moe
    from shardlm.errors import UsageError
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.dims import LayoutError
    from shardlm.train.trainer import TrainConfig, check_trainable

    with pytest.raises(UsageError, match=r"aux_loss_coef=0.01 balances .* pp=2 stages and grad_accum=2 .* use pp=1"):
        TrainConfig.of(pp=2, grad_accum=2, aux_loss_coef=0.01)
    with pytest.raises(UsageError, match="aux_loss_coef=-1 must be >= 0"):
        TrainConfig(aux_loss_coef=-1)
    v3 = open_checkpoint(cached_tiny_moe("deepseek_v3", tmp_path_factory).path).config
    check_trainable(v3, 4)
    with pytest.raises(LayoutError, match="cp=2: context parallelism does not run multi-head latent attention"):
        check_trainable(v3, 1, cp=2)
    with pytest.raises(UsageError, match="dtype='bfloat16': deepseek_v3's router stays in float32"):
        check_trainable(v3, 1, dtype="bfloat16")
    with pytest.raises(UsageError, match="aux_loss_coef=0.01: deepseek_v3 balances its experts without"):
        check_trainable(v3, 1, aux_loss_coef=0.01)
    check_trainable(v3, 1, bias_update_rate=0.001)
    mixtral = open_checkpoint(cached_tiny_moe("mixtral", tmp_path_factory).path).config
    with pytest.raises(UsageError, match="bias_update_rate=0.001: mixtral has no expert correction bias"):
        check_trainable(mixtral, 1, bias_update_rate=0.001)
    with pytest.raises(UsageError, match="bias_update_rate=-1 must be >= 0"):
        TrainConfig(bias_update_rate=-1)

"""Training on every layout takes HF transformers' steps: same losses, same weights after.

The reference is HF's model trained in this process with torch's AdamW and
clip_grad_norm_ on the same batches. Every layout (dp with ZeRO 0-3, tp, dp x tp,
gradient accumulation, uneven shards at dp=3) must give the same loss and gradient norm at
every step (rtol 1e-5) and the same weights after three steps. tp and dp sum gradients in a
different order, which moves float32 gradients by ~1e-7 relative; Adam divides each gradient
by its own running magnitude, so where a gradient is near zero that difference becomes a
visible one in the step: the largest weight difference measured is 2.4e-5 (one element of
4608), typical ones ~1e-7. So: every weight within atol 1e-4, and the mean difference per
tensor below 1e-6, while three steps of lr 1e-3 move the weights by ~3e-3.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from harness.cli import main_exit, shardlm
from harness.multirank import run_ranks, run_ranks_on
from harness.overlap_rankfns import step_events
from harness.rankfns import (
    evaluate_and_step,
    layer_activations_on_rank,
    pipeline_ops,
    resume_and_step,
    train_and_save,
    train_and_save_state,
    train_steps,
)
from harness.reference import PROMPTS

OPTIM = dict(lr=1e-3, eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
STEPS, BATCH, SEQ = 3, 12, 16  # 12 sequences split over dp = 1, 2, 3 and 2 x 2 micro-batches


@pytest.fixture(scope="module")
def hf_run(tiny):
    """(model path, batches, HF's (loss, grad norm) per step, HF's weights before and after)."""
    return hf_training(str(tiny("llama").path))


def hf_training(path: str, aux_loss_coef: float | None = None):
    """HF's own training of the model at ``path`` on STEPS random batches: (path, batches, (loss,
    grad norm) per step, weights before, weights after). ``aux_loss_coef``: an MoE model's
    load-balancing loss joins the loss with this weight (HF's output_router_logits)."""
    import transformers

    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 251, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    before = _as_saved(hf)
    opt = torch.optim.AdamW(
        hf.parameters(), lr=OPTIM["lr"], betas=(0.9, 0.95), eps=OPTIM["eps"], weight_decay=OPTIM["weight_decay"]
    )
    stats = []
    for b in batches:
        out = hf(b[:, :-1], output_router_logits=aux_loss_coef is not None)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), b[:, 1:].flatten())
        if aux_loss_coef is not None:
            loss = loss + aux_loss_coef * out.aux_loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM["max_grad_norm"])
        opt.step()
        opt.zero_grad()
        stats.append((loss.item(), norm.item()))
    return path, batches, stats, before, _as_saved(hf)


def _as_saved(hf) -> dict[str, torch.Tensor]:
    """The model's weights under the names its saved checkpoint gives them (the names shardlm
    loads and saves: transformers keeps experts fused in memory, one tensor each in the file)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return load_file(f"{d}/model.safetensors")


def check_against_hf(results, hf_run) -> None:
    _, _, hf_stats, before, after = hf_run
    for rank, (stats, pieces, _, _) in enumerate(results):
        got = [(s["loss"], s["grad_norm"]) for s in stats]
        torch.testing.assert_close(
            got, hf_stats, rtol=1e-5, atol=0, msg=lambda m: f"rank {rank}: losses / grad norms: {m}"
        )
        for p in pieces:
            want = after[p.name][p.rows or slice(None)]
            want = want if p.cols is None else want[:, p.cols]
            torch.testing.assert_close(p.tensor, want, rtol=0, atol=1e-4, msg=lambda m: f"rank {rank}: {p.name}: {m}")
            assert (p.tensor - want).abs().mean() < 1e-6, f"rank {rank}: {p.name}"
    # it can fail: training moved the weights far beyond the tolerance, and the loss changed
    assert max((after[n] - before[n]).abs().max().item() for n in after) > 1e-3
    assert len({round(loss, 3) for loss, _ in hf_stats}) == STEPS


# (dp, tp, zero, extra options); grouped by world size so each rank pool starts once
LAYOUTS = [
    (1, 1, 0, {}),
    (1, 1, 0, {"cp": 2}),  # context parallel: each sequence's zig-zag halves on two ranks
    (1, 1, 3, {"cp": 2}),
    (2, 1, 0, {}),
    (2, 1, 1, {}),
    (2, 1, 2, {"grad_accum": 2}),
    (2, 1, 3, {}),
    (1, 2, 1, {}),
    (3, 1, 3, {}),  # shards of uneven size
    (2, 2, 2, {}),
    (2, 2, 3, {}),
    (2, 1, 2, {"cp": 2}),
    (1, 2, 1, {"cp": 2}),
    # ring attention: key/value blocks passed around the cp ranks
    (1, 1, 0, {"cp": 2, "cp_attention": "ring"}),
    (1, 1, 3, {"cp": 4, "cp_attention": "ring"}),
    (1, 2, 2, {"cp": 2, "cp_attention": "ring", "sequence_parallel": True}),
    # Ulysses: all-to-alls split the heads (2 KV heads) over the cp ranks for attention
    (1, 1, 0, {"cp": 2, "cp_attention": "ulysses"}),
    (2, 1, 3, {"cp": 2, "cp_attention": "ulysses"}),
    # pipeline: 1F1B over the micro-batches; the tied embedding lives on the first and last stage
    (1, 1, 0, {"pp": 2, "grad_accum": 4}),
    (1, 1, 3, {"pp": 2, "grad_accum": 2}),
    (1, 1, 1, {"pp": 3, "grad_accum": 4}),
    (2, 1, 2, {"pp": 2, "grad_accum": 2}),
    # sequence parallel: tokens split over tp between the tp regions
    (1, 2, 0, {"sequence_parallel": True}),
    (2, 2, 3, {"sequence_parallel": True}),
    (1, 2, 1, {"sequence_parallel": True, "pp": 2, "grad_accum": 2}),
    (1, 2, 2, {"sequence_parallel": True, "cp": 2}),
    # activation recomputation: each layer's forward again in backward (ZeRO-3 gathers again)
    (1, 1, 0, {"recompute": "full"}),
    (2, 1, 3, {"recompute": "full"}),
    # selective: the SwiGLU activation recomputed inside the down projection's backward
    (1, 1, 0, {"recompute": "selective"}),
    (1, 2, 3, {"recompute": "selective", "sequence_parallel": True}),
    # overlap (train/overlap.py): buckets of one layer, and of three (rank-major, uneven over dp=3);
    # two layers prefetched through 1F1B; and both turned off
    (2, 1, 0, {"bucket_mb": 0.5}),
    (2, 1, 2, {"bucket_mb": 0}),
    (2, 1, 3, {"prefetch": 0}),
    (3, 1, 2, {"bucket_mb": 1.0}),
    (2, 1, 3, {"pp": 2, "grad_accum": 2, "prefetch": 2}),
    # the other pipeline schedules (parallel/schedules.py): GPipe; interleaved over 3 chunks of one
    # layer per stage; ZB-H1's split backward through ZeRO 0, 2 and 3 (more in SCHEDULE_LAYOUTS)
    (1, 1, 0, {"pp": 2, "grad_accum": 4, "pp_schedule": "gpipe"}),
    (1, 1, 0, {"pp": 2, "grad_accum": 4, "pp_schedule": "interleaved", "vpp": 3}),
    (2, 1, 3, {"pp": 2, "grad_accum": 2, "pp_schedule": "interleaved", "vpp": 3}),
    (1, 1, 0, {"pp": 2, "grad_accum": 4, "pp_schedule": "zb-h1"}),
    (2, 1, 2, {"pp": 2, "grad_accum": 2, "pp_schedule": "zb-h1"}),
    (2, 1, 3, {"pp": 2, "grad_accum": 2, "pp_schedule": "zb-h1"}),
]
# pp x tp at ZeRO-3 and with full recomputation (~6-9 s each; make test has pp x tp with SP, and
# full recomputation without pp): in the slow tier
SLOW_LAYOUTS = [(1, 2, 3, {"pp": 2, "grad_accum": 2}), (1, 2, 1, {"recompute": "full", "pp": 2, "grad_accum": 2})]
# the schedules composed with the rest: pp=3, tp with sequence parallelism, full recomputation,
# cp, one stage (~6 s each, in the slow tier: the fast one is at its 15-minute budget)
SCHEDULE_LAYOUTS = [
    (1, 1, 1, {"pp": 3, "grad_accum": 3, "pp_schedule": "interleaved", "vpp": 2}),
    (1, 2, 2, {"pp": 2, "grad_accum": 2, "pp_schedule": "interleaved", "vpp": 3, "sequence_parallel": True}),
    (1, 1, 3, {"pp": 2, "cp": 2, "grad_accum": 2, "pp_schedule": "interleaved", "vpp": 3, "recompute": "full"}),
    (1, 1, 1, {"pp": 3, "grad_accum": 4, "pp_schedule": "zb-h1"}),
    (1, 2, 1, {"pp": 2, "grad_accum": 2, "pp_schedule": "zb-h1", "sequence_parallel": True}),
    (1, 1, 0, {"grad_accum": 2, "pp_schedule": "zb-h1"}),
    (1, 1, 0, {"pp": 2, "grad_accum": 2, "pp_schedule": "zb-h1", "recompute": "full"}),
    (1, 1, 0, {"pp": 2, "cp": 2, "grad_accum": 2, "pp_schedule": "zb-h1"}),
]


def _layout_id(dp, tp, zero, extra) -> str:
    accum = f"-accum{extra['grad_accum']}" if "grad_accum" in extra else ""
    sp = "-sp" if extra.get("sequence_parallel") else ""
    sp += f"-recompute-{extra['recompute']}" if "recompute" in extra else ""
    ring = f"-{extra['cp_attention']}" if "cp_attention" in extra else ""
    overlap = "".join(f"-{k.replace('_', '')}{extra[k]}" for k in ("bucket_mb", "prefetch") if k in extra)
    schedule = f"-{extra['pp_schedule']}{extra.get('vpp', '')}" if "pp_schedule" in extra else ""
    return f"dp{dp}-pp{extra.get('pp', 1)}{schedule}-cp{extra.get('cp', 1)}{ring}-tp{tp}{sp}-zero{zero}{accum}{overlap}"


@pytest.mark.parametrize(
    "dp,tp,zero,extra",
    [pytest.param(*layout, id=_layout_id(*layout)) for layout in LAYOUTS]
    + [
        pytest.param(*layout, id=_layout_id(*layout), marks=pytest.mark.slow)
        for layout in SLOW_LAYOUTS + SCHEDULE_LAYOUTS
    ],
)
def test_layout_matches_hf(hf_run, dp, tp, zero, extra):
    path, batches = hf_run[:2]
    pp, cp = extra.get("pp", 1), extra.get("cp", 1)
    results = run_ranks(dp * pp * cp * tp, train_steps, path, batches, dp, tp, zero, **OPTIM, **extra)
    check_against_hf(results, hf_run)
    for _stats, _, held, (owned, numel) in results:
        # ZeRO's table (zero.py): what a rank keeps, in float32 elements; Adam keeps two per element
        assert held["weights"] == 4 * (owned if zero == 3 else numel)
        assert held["gradients"] == 4 * (owned if zero >= 2 else numel)
        assert held["optimizer"] == 8 * (numel if zero == 0 else owned)
    if zero > 0 and dp * cp > 1:  # the dp x cp ranks of one (pp, tp) position own disjoint parts of everything
        from shardlm.parallel.dims import ParallelDims

        for ranks in ParallelDims(dp=dp, pp=pp, cp=cp, tp=tp).group_ranks("dp_cp"):
            held = [results[r][3] for r in ranks]
            assert sum(o for o, _ in held) == held[0][1]


@pytest.mark.parametrize(
    "dtype,dp,tp,zero",
    [
        ("bfloat16", 1, 1, 1),
        ("bfloat16", 2, 1, 2),
        ("bfloat16", 2, 1, 3),
        ("bfloat16", 1, 2, 0),
        ("float16", 1, 1, 1),
        ("float16", 2, 1, 3),
    ],
)
def test_16bit_with_float32_masters(hf_run, dtype, dp, tp, zero):
    """bfloat16 (or float16, loss-scaled) weights, activations and gradients, float32 master
    weights in the optimizer: HF's float32 steps within bfloat16's error. Losses rtol 2e-2.
    Weights, stored in 16 bits: within 1e-2, and on average within 0.5% of the tensor's mean |w|
    (bfloat16 keeps 8 bits: 0.4%; measured up to 0.31%). Without float32 masters the three steps
    of lr 1e-3 (~3e-3 a weight, ~1.5% of a mean |w| of 0.2) would mostly round away against a
    spacing of 1e-3-8e-3."""
    path, batches, hf_stats, _, after = hf_run
    results = run_ranks(dp * tp, train_steps, path, batches, dp, tp, zero, dtype=dtype, **OPTIM)
    for rank, (stats, pieces, held, (owned, numel)) in enumerate(results):
        torch.testing.assert_close([s["loss"] for s in stats], [loss for loss, _ in hf_stats], rtol=2e-2, atol=0)
        # the gradient norm (float16: after unscaling) within 5%; Adam alone would not notice a scale
        torch.testing.assert_close([s["grad_norm"] for s in stats], [n for _, n in hf_stats], rtol=5e-2, atol=0)
        assert all(not s.get("skipped") for s in stats)  # float16: 2^16 overflows nothing here
        for p in pieces:
            want = after[p.name][p.rows or slice(None)]
            want = want if p.cols is None else want[:, p.cols]
            diff = (p.tensor.float() - want).abs()
            assert p.tensor.dtype == getattr(torch, dtype), p.name
            assert diff.max() < 1e-2 and diff.mean() < 5e-3 * want.abs().mean(), (rank, p.name)
        # ZeRO's table with 16-bit weights: 2 bytes of weights, 2 of gradients (owned ones summed in
        # float32: 4), 12 of optimizer state (float32 master, momentum, variance)
        assert held["weights"] == 2 * (owned if zero == 3 else numel)
        assert held["gradients"] == {0: 2 * numel, 1: 2 * numel, 2: 4 * owned, 3: 2 * owned}[zero]
        assert held["optimizer"] == 12 * (numel if zero == 0 else owned)


def test_a_closed_trainer_and_llm_refuse_with_a_message(tiny):
    """close() lets go of the model (what the exit handler relies on, launch._end_group); a later
    step or generate is refused with a UsageError, not an AttributeError or an assert."""
    from shardlm import LLM, SamplingParams
    from shardlm.errors import UsageError
    from shardlm.train.trainer import TrainConfig, Trainer

    path = str(tiny("llama").path)
    trainer = Trainer(TrainConfig(model=path))
    trainer.close()
    with pytest.raises(UsageError, match="this Trainer is closed"):
        trainer.step(torch.zeros(2, 9, dtype=torch.long))
    assert not hasattr(trainer, "zero")  # probes see nothing (ClosedError is an AttributeError too)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        Trainer.__getattr__(object.__new__(Trainer), "nothing")  # an open trainer's missing name stays one
    with LLM(path, threads=1) as llm:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))
    with pytest.raises(UsageError, match="this LLM is closed"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1))


def test_zero3_reduces_a_units_16_bit_gradient_as_a_float32_copy(tiny, monkeypatch):
    """What the planner counts for a ZeRO-3 unit in backward (plan/memory.py ZERO3_GRAD_BYTES):
    its whole 16-bit gradient and the float32 copy that is reduce-scattered."""
    from shardlm.train import zero
    from shardlm.train.trainer import TrainConfig, Trainer

    sent, real = [], zero.reduce_scatter
    monkeypatch.setattr(
        zero, "reduce_scatter", lambda x, *a, **k: sent.append((x.dtype, x.numel())) or real(x, *a, **k)
    )
    trainer = Trainer(TrainConfig(model=str(tiny("llama").path), zero=3, dtype="bfloat16"))
    trainer.step(torch.randint(0, 251, (2, 9), generator=torch.Generator().manual_seed(3)))
    units = trainer.zero.units
    assert {u.shard.dtype for u in units} == {torch.bfloat16}
    assert sorted(sent) == sorted((torch.float32, sum(u.sizes)) for u in units)


def test_zero3_gathers_again_for_backward_and_recompute_reruns_layers(tiny, monkeypatch):
    """What equal losses cannot show: ZeRO-3 keeps no gathered weights from forward to backward
    (every unit is gathered exactly twice a step, once for each), and full recomputation runs
    every layer's forward again in backward."""
    from shardlm.train import zero
    from shardlm.train.trainer import TrainConfig, Trainer

    path = str(tiny("llama").path)
    batch = torch.randint(0, 251, (2, 9), generator=torch.Generator().manual_seed(3))
    gathers, real = [], zero.Unit.gather
    monkeypatch.setattr(zero.Unit, "gather", lambda unit: gathers.append(unit) or real(unit))
    trainer = Trainer(TrainConfig(model=path, zero=3))
    trainer.step(batch)
    units = trainer.zero.units
    assert sorted(map(id, gathers)) == sorted(map(id, units * 2))
    assert all(u.regathered is None for u in units)  # dropped once each unit's backward ended
    # over two ranks too (where a gathered vector is a view of all_gather's buffer); the log of
    # every gather, without prefetching (test_overlap.py: with)
    for log in run_ranks(2, step_events, path, batch, dp=2, zero=3, prefetch=0):
        assert sorted(e[2] for e in log if e[0] == "gather") == sorted(list(range(len(units))) * 2)
    for recompute, runs in (("none", 1), ("full", 2)):
        trainer, calls = Trainer(TrainConfig(model=path, recompute=recompute)), []
        for layer in trainer.model.modules():
            if type(layer).__name__ == "DecoderLayer":
                layer.register_forward_pre_hook(lambda m, args: calls.append(m))
        trainer.step(batch)
        assert len(calls) == runs * trainer.checkpoint.config.num_layers, recompute


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2**-8)])  # bf16: one rounding
def test_rms_norm_keeps_only_its_input_and_the_inverse_rms(dtype, rtol):
    """Training's RMSNorm: F.rms_norm's output, gradients of its float32 recipe (bfloat16: the
    float32 gradients rounded once), and for backward only the input and 1/rms per token (autograd
    through F.rms_norm keeps two float32 copies of the input's size)."""
    import torch.nn.functional as F

    from shardlm.models.transformer import _RMSNormFunction

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(96, generator=g) * 0.3 + 1).to(dtype).requires_grad_()
    grad = torch.randn(64, 96, generator=g).to(dtype)
    ref = F.rms_norm(x.float(), (96,), w.float(), 1e-5)
    ref.backward(grad.float())
    want = x.grad.to(dtype), w.grad.to(dtype)
    x.grad = w.grad = None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = _RMSNormFunction.apply(x, w, 1e-5)
    y.backward(grad)
    assert torch.equal(y, F.rms_norm(x, (96,), w, 1e-5))
    torch.testing.assert_close((x.grad, w.grad), want, atol=1e-5, rtol=rtol)
    assert sorted(t.numel() * t.element_size() for t in saved) == sorted([x.nbytes, w.nbytes, 64 * 4])


@pytest.mark.parametrize(
    "tp,options",
    [
        (1, {}),
        (1, {"recompute": "full"}),
        (1, {"recompute": "selective"}),
        (2, {}),
        (2, {"sequence_parallel": True}),
        (2, {"sequence_parallel": True, "recompute": "full"}),
        (2, {"sequence_parallel": True, "recompute": "selective"}),
    ],
    ids=["tp1", "tp1-full", "tp1-selective", "tp2", "tp2-sp", "tp2-sp-full", "tp2-sp-selective"],
)
def test_planner_activation_count_is_what_a_layer_saves(tiny, tp, options):
    """The planner's per-layer activation bytes (plan/activations.py) against what autograd
    saves for one decoder layer of a bfloat16 step, on every rank: within 2% (measured: the
    norms' float32 1/rms per token, 0.3-1.5%, is the only thing the count leaves out)."""
    from shardlm.models.loader import open_checkpoint
    from shardlm.plan.activations import layer_activation_bytes
    from shardlm.plan.memory import layer_shape
    from shardlm.plan.roofline import ModelCosts

    path, seq, batch = str(tiny("llama").path), 32, 4
    got = run_ranks(tp, layer_activations_on_rank, path, tp, seq, batch, **options)
    want = layer_activation_bytes(
        layer_shape(ModelCosts(open_checkpoint(path).config), False),
        seq=seq,
        micro_batch=batch,
        tp=tp,
        sp=options.get("sequence_parallel", False),
        recompute=options.get("recompute", "none"),
    )
    for rank, n in enumerate(got):
        assert want <= n <= 1.02 * want, (rank, n, want)


def _world(layout: dict) -> int:
    return math.prod(layout.get(a, 1) for a in ("dp", "pp", "cp", "tp"))


@pytest.mark.parametrize(
    "saved,resumed",
    [
        (dict(dp=2, zero=2), dict(dp=2, zero=2)),
        (
            dict(tp=2, pp=2, zero=3, grad_accum=2, dtype="bfloat16"),
            dict(tp=2, pp=2, zero=3, grad_accum=2, dtype="bfloat16"),
        ),
        (dict(dp=2, zero=3), dict(tp=2, zero=1)),
        pytest.param(dict(pp=2, tp=2, zero=1, grad_accum=2), dict(dp=2, cp=2, zero=2), marks=pytest.mark.slow),
        pytest.param(  # ~10 s; make test keeps pp2-tp2-zero3-bf16's bfloat16 state across layouts
            dict(dp=2, zero=3, dtype="bfloat16"),
            dict(pp=2, tp=2, zero=0, grad_accum=2, dtype="bfloat16"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "dp2-zero2",
        "pp2-tp2-zero3-bf16",
        "dp2-zero3-to-tp2",
        "pp2-tp2-to-dp2-cp2",
        "bf16-dp2-zero3-to-pp2-tp2-zero0",
    ],
)
def test_resumed_training_takes_the_same_step(hf_run, tmp_path, saved, resumed):
    """Two steps at one layout, save the state, a new run at another layout loads it: its weights
    are bitwise the saved ones (DCP resharded the float32 masters exactly), and its third step is
    the uninterrupted run's at that layout: bitwise on the same layout, on another within float32
    reduction order (loss and grad norm rtol 1e-5, weights as test_layout_matches_hf holds them to
    HF's), bfloat16 within test_16bit_with_float32_masters' tolerances. So AdamW's moments and step count came
    back too."""
    path, batches = hf_run[:2]
    kept = run_ranks(_world(saved), train_and_save_state, path, batches[:2], str(tmp_path), **OPTIM, **saved)
    back = run_ranks(_world(resumed), resume_and_step, path, batches[2], str(tmp_path), **OPTIM, **resumed)
    dp, tp, zero = (resumed.get(a, 1) for a in ("dp", "tp", "zero"))
    options = {k: v for k, v in resumed.items() if k not in ("dp", "tp", "zero")}
    straight = run_ranks(_world(resumed), train_steps, path, batches, dp, tp, zero, **OPTIM, **options)
    from shardlm.train.checkpoint import assemble

    everything = lambda per_rank: assemble([p for part in per_rank for p in part])
    before = everything(kept)
    assert {t for t, _, _, _ in back} == {2}
    loaded = everything([p for _, p, _, _ in back])
    assert loaded.keys() == before.keys() and all(torch.equal(loaded[k], before[k]) for k in before)
    same = saved == resumed
    bf16 = resumed.get("dtype") == "bfloat16"
    for (_, _, stats, _), (want, _, _, _) in zip(back, straight):
        got, expect = (stats["loss"], stats["grad_norm"]), (want[-1]["loss"], want[-1]["grad_norm"])
        if same:
            assert got == expect
        elif bf16:  # test_16bit_with_float32_masters' tolerances: loss 2e-2, gradient norm 5e-2
            torch.testing.assert_close(got[0], expect[0], rtol=2e-2, atol=0)
            torch.testing.assert_close(got[1], expect[1], rtol=5e-2, atol=0)
        else:
            torch.testing.assert_close(got, expect, rtol=1e-5, atol=0)
    after, want = everything([p for _, _, _, p in back]), everything([p for _, p, _, _ in straight])
    for k in want:
        if same:
            assert torch.equal(after[k], want[k]), k
        elif bf16:  # as test_16bit_with_float32_masters holds them to HF's float32 weights
            diff = (after[k].float() - want[k].float()).abs()
            assert diff.max() < 1e-2 and diff.mean() < 5e-3 * want[k].float().abs().mean(), k
        else:  # as the layouts against HF: Adam's update of a tiny gradient amplifies the reduction order
            torch.testing.assert_close(after[k], want[k], rtol=0, atol=1e-4, msg=k)
            assert (after[k] - want[k]).abs().mean() < 1e-6, k
    # the state is a DCP checkpoint, one file per rank, that meta.json points at
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["meta.json", "step-2"]
    files = sorted(p.name for p in (tmp_path / "state" / "step-2").iterdir())
    assert files == [".metadata"] + [f"__{r}_0.distcp" for r in range(_world(saved))]
    from torch.distributed.checkpoint import FileSystemReader

    names = FileSystemReader(str(tmp_path / "state" / "step-2")).read_metadata().state_dict_metadata
    assert "model.layers.0.self_attn.q_proj.weight" in names and "optimizer.exp_avg_sq.model.norm.weight" in names
    # it can fail: a fresh model (no state loaded) takes a different third step
    from shardlm.train.trainer import TrainConfig, Trainer

    dtype = {k: v for k, v in saved.items() if k == "dtype"}
    other = Trainer(TrainConfig(model=path, **OPTIM, **dtype))
    assert other.step(batches[-1])["loss"] != straight[0][0][-1]["loss"]
    from shardlm.errors import UsageError

    with pytest.raises(UsageError, match="holds no training state"):
        other.load_state(str(tmp_path / "nothing"))


def test_state_of_another_model_is_refused(hf_run, tiny, tmp_path):
    from shardlm.errors import UsageError
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    trainer = Trainer(TrainConfig(model=path, **OPTIM))
    trainer.step(batches[0])
    trainer.save_state(str(tmp_path))
    other = Trainer(TrainConfig(model=str(tiny("qwen2").path), **OPTIM))
    with pytest.raises(UsageError, match="saved for another model"):
        other.load_state(str(tmp_path))


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(), id="one"),
        pytest.param(dict(pp=2, tp=2, zero=3, grad_accum=2), id="pp2-tp2", marks=pytest.mark.slow),  # ~8 s
        pytest.param(dict(dp=2, cp=2, zero=2), id="dp2-cp2"),
        pytest.param(
            dict(pp=2, grad_accum=2, pp_schedule="interleaved", vpp=3), id="pp2-interleaved"
        ),  # the chunks in order
    ],
)
def test_evaluate_is_hfs_loss_and_trains_nothing(hf_run, layout):
    """Trainer.evaluate (--eval-every): HF's loss on the batch, over every token of it, and the
    training step after it is HF's first step (evaluation left no gradient or state behind)."""
    path, batches, hf_stats = hf_run[:3]
    for ev, stats in run_ranks(_world(layout), evaluate_and_step, path, batches[0], **OPTIM, **layout):
        assert ev["tokens"] == BATCH * SEQ
        torch.testing.assert_close(ev["loss"], hf_stats[0][0], rtol=1e-5, atol=0)
        torch.testing.assert_close((stats["loss"], stats["grad_norm"]), hf_stats[0], rtol=1e-5, atol=0)
    assert hf_stats[0][0] != hf_stats[1][0]  # can fail: another batch's loss differs


@pytest.mark.slow
def test_compiled_layers_take_hfs_steps(hf_run):
    """--compile at tp=2 (its all-reduces inside the compiled graphs), ZeRO-2 and selective
    recomputation: HF's steps as eager (test_layout_matches_hf's tolerances)."""
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    results = run_ranks(2, train_steps, path, batches, 1, 2, 2, compile=True, recompute="selective", **OPTIM)
    check_against_hf(results, hf_run)
    layers = Trainer(TrainConfig(model=path, compile=True)).model.layers
    assert all(layer._compiled_call_impl is not None for layer in layers)  # compiled, not eager


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("zero", [1, 3])
def test_training_on_cuda_matches_hf(hf_run, zero):
    """The same trainer on a GPU (world size 1 under NCCL: one GPU here; multi-rank layouts are
    the CPU ranks' tests): HF's steps within test_layout_matches_hf's tolerances (float32, no TF32:
    torch's default)."""
    path, batches = hf_run[:2]
    results = run_ranks_on("nccl", 1, train_steps, path, batches, 1, 1, zero, device="cuda", dtype="float32", **OPTIM)
    check_against_hf(results, hf_run)


@needs_cuda
def test_cuda_trains_bfloat16_by_default_and_resumes_a_cpu_state(hf_run, tmp_path):
    from shardlm.train.checkpoint import assemble
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    assert Trainer(TrainConfig(model=path, device="cuda")).dtype_name == "bfloat16"
    kept = run_ranks(2, train_and_save_state, path, batches[:2], str(tmp_path), device="cpu", dp=2, zero=3, **OPTIM)
    [(taken, loaded, stats, _)] = run_ranks_on(
        "nccl", 1, resume_and_step, path, batches[2], str(tmp_path), device="cuda", dtype="float32", **OPTIM
    )
    want = assemble([p for part in kept for p in part])
    assert taken == 2 and all(torch.equal(assemble(loaded)[k], want[k]) for k in want)
    torch.testing.assert_close(stats["loss"], hf_run[2][2][0], rtol=1e-5, atol=0)


@needs_cuda
def test_optimizer_offload_on_cuda_keeps_masters_in_cpu_memory_and_takes_hfs_steps(hf_run):
    """--offload optimizer on the GPU: masters (and so AdamW's moments) in pinned CPU memory, none of
    the optimizer's bytes on the device (as the planner counts them), and HF's steps (test_layout_matches_hf's tolerances)."""
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    t = Trainer(TrainConfig(model=path, device="cuda", dtype="bfloat16", offload="optimizer"))
    assert all(u.master.device.type == "cpu" and u.master.is_pinned() for u in t.zero.units)
    stats = t.step(batches[0])
    # none on the device, 12 bytes per parameter on the host: the planner's count (test_plan_memory)
    numel = sum(u.numel for u in t.zero.units)
    assert stats["state_bytes"]["optimizer"] == 0 and stats["state_bytes"]["optimizer_offloaded"] == 12 * numel
    results = run_ranks_on(
        "nccl", 1, train_steps, path, batches, 1, 1, 2, device="cuda", dtype="float32", offload="optimizer", **OPTIM
    )
    check_against_hf(results, hf_run)


def test_optimizer_offload_on_cpu_ranks_changes_nothing(hf_run):
    """On CPU ranks the optimizer is in CPU memory already: the same steps, bit for bit."""
    from shardlm.errors import UsageError
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    runs = []
    for offload in (None, "optimizer"):
        t = Trainer(TrainConfig(model=path, offload=offload, **OPTIM))
        runs.append([(s["loss"], s["grad_norm"]) for s in map(t.step, batches)])
        assert not any(u.offloaded for u in t.zero.units)
    assert runs[0] == runs[1]
    with pytest.raises(UsageError, match="offload='weights': only the optimizer offloads"):
        TrainConfig(offload="weights")


def test_float16_skips_an_overflowing_step_and_halves_the_scale(hf_run, tmp_path):
    """A loss scale of 2^40 overflows float16 gradients: that step changes no weight and the scale
    halves; at 2^8 the next step trains. The scaler's state comes back on resume."""
    from shardlm.train.trainer import TrainConfig, Trainer

    path, batches = hf_run[:2]
    trainer = Trainer(TrainConfig(model=path, dtype="float16", loss_scale=2.0**40, **OPTIM))
    before = [u.master.detach().clone() for u in trainer.zero.units]
    stats = trainer.step(batches[0])
    assert stats["skipped"] and stats["loss_scale"] == 2.0**40 and trainer.scaler.scale == 2.0**39
    assert all(torch.equal(a, u.master) for a, u in zip(before, trainer.zero.units))
    trainer.scaler.scale = 2.0**8
    stats = trainer.step(batches[1])
    assert not stats["skipped"] and trainer.scaler.good == 1
    assert not all(torch.equal(a, u.master) for a, u in zip(before, trainer.zero.units))
    trainer.save_state(str(tmp_path))
    resumed = Trainer(TrainConfig(model=path, dtype="float16", **OPTIM))
    assert resumed.load_state(str(tmp_path)) == 2 and (resumed.scaler.scale, resumed.scaler.good) == (2.0**8, 1)


def test_saved_model_is_hf_trained_model(hf_run, tmp_path):
    """pp=2 x tp=2 at ZeRO-3 saves a directory HF loads, holding the weights HF trained itself
    (pieces of two stages and two tp ranks, the tied embedding held by both stages once)."""
    import transformers

    path, batches, _, _, after = hf_run
    run_ranks(4, train_and_save, path, batches, 1, 2, 3, str(tmp_path), pp=2, grad_accum=2, **OPTIM)
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got = dict(saved.named_parameters())
    assert got.keys() == after.keys()
    for name, want in after.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(pp=3, grad_accum=4), marks=pytest.mark.slow, id="1f1b"),  # its order: a unit test
        pytest.param(dict(pp=2, grad_accum=4, pp_schedule="gpipe"), marks=pytest.mark.slow, id="gpipe"),
        pytest.param(dict(pp=2, grad_accum=4, pp_schedule="interleaved", vpp=3), id="interleaved"),
        pytest.param(dict(pp=3, grad_accum=4, pp_schedule="zb-h1"), id="zb-h1"),
    ],
)
def test_each_stage_runs_its_schedule_and_holds_what_it_defines(hf_run, options):
    """The operations every stage ran, in order, are its schedule's (parallel/schedules.py), and
    the activations it held at once (counted as they are kept and freed) are what the schedule
    defines: 1F1B p - s, GPipe m, ZB-H1 at most p, interleaved Megatron's warm-up."""
    from shardlm.parallel.schedules import in_flight, stage_orders

    path, batches = hf_run[:2]
    pp, m = options["pp"], options["grad_accum"]
    schedule, vpp = options.get("pp_schedule", "1f1b"), options.get("vpp", 1)
    orders = stage_orders(schedule, pp, m, vpp)
    for stage, ops, held in run_ranks(pp, pipeline_ops, path, batches[0], **options):
        assert ops == orders[stage]
        assert held == in_flight(orders[stage])
    if schedule == "1f1b":
        assert [in_flight(o) for o in orders] == [3, 2, 1]
    if schedule == "zb-h1":
        assert [in_flight(o) for o in orders] == [3, 3, 3]


@pytest.mark.parametrize("name", ["llama", "llama_bias", "qwen2", "qwen3", "mistral"])
def test_hf_config_round_trip(tiny, name):
    import dataclasses

    from shardlm.models.config import ModelConfig
    from shardlm.models.loader import open_checkpoint

    cfg = open_checkpoint(tiny(name).path).config
    back = ModelConfig.from_hf(cfg.to_hf())
    assert dataclasses.replace(back, extra=cfg.extra) == cfg


def test_bad_input_is_refused_with_a_reason(tiny):
    from shardlm.errors import UsageError
    from shardlm.models.loader import open_checkpoint
    from shardlm.parallel.dims import LayoutError
    from shardlm.train.trainer import TrainConfig, Trainer, check_trainable

    with pytest.raises(UsageError, match=r"zero=4 is not a ZeRO stage; use one of \(0, 1, 2, 3\)"):
        TrainConfig(zero=4)
    with pytest.raises(UsageError, match="lr=0"):
        TrainConfig(lr=0)
    with pytest.raises(UsageError, match="dtype='int8' is not supported for training"):
        TrainConfig(dtype="int8")
    with pytest.raises(UsageError, match=r"prefetch=-1 must be a whole number of layers >= 0, e.g. 1 \(0: off\)"):
        TrainConfig(prefetch=-1)
    with pytest.raises(UsageError, match=r"bucket_mb=nan must be >= 0 MiB, e.g. 25 \(0: no overlap\)"):
        TrainConfig(bucket_mb=float("nan"))
    llama = open_checkpoint(tiny("llama").path).config  # 6 query heads, 2 KV heads
    with pytest.raises(LayoutError, match=r"tp=3 splits a KV head's query group .* use tp in \[1, 2\]"):
        check_trainable(llama, 3)
    with pytest.raises(LayoutError, match=r"cp=2: Ulysses splits attention heads .* use cp in \[1, 3\]"):
        check_trainable(llama, 2, cp=2, cp_attention="ulysses")  # a tp rank's KV head of 3 query heads
    with pytest.raises(UsageError, match=r"cp_attention='ring' spreads attention over cp ranks, and cp=1"):
        TrainConfig(cp_attention="ring")
    check_trainable(open_checkpoint(tiny("qwen3").path).config, 2)  # Qwen3's q/k norms train (test_train_families.py)
    trainer = Trainer(TrainConfig(model=str(tiny("llama").path), grad_accum=2))
    with pytest.raises(UsageError, match="batch of 5 sequences does not split into dp=1 x grad_accum=2"):
        trainer.step(torch.zeros(5, 9, dtype=torch.long))
    with pytest.raises(UsageError, match=r"\[sequences, seq_len \+ 1\]"):
        trainer.step(torch.zeros(8, dtype=torch.long))
    from shardlm.parallel.context import zigzag_positions

    with pytest.raises(LayoutError, match=r"seq_len=18 does not split into 2 x cp = 4 equal chunks .* e.g. 16"):
        zigzag_positions(18, 2, 0)
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7] and zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


@pytest.mark.slow
def test_cli_trains_smollm2_over_two_ranks(tmp_path, hf_smollm2):
    """Context parallel with ring attention (each sequence's zig-zag halves on two ranks), ZeRO-2
    over those two, flags from a --config file, a warm-up and cosine decay; --checkpoint and
    resuming from it (the state's contents: test_resumed_...)."""
    data = tmp_path / "data.txt"
    data.write_text("Tensor parallelism splits every weight matrix over the ranks of a group. " * 30)
    config = tmp_path / "run.toml"
    config.write_text(
        f'data = "{data}"\ncp = 2\ncp-attention = "ring"\nzero = 2\nbatch_size = 2\nseq-len = 16\n'
        'lr = 2e-4\nlr-schedule = "cosine"\nwarmup-steps = 1\nthreads = 1\njson = true\nsteps = 99\n'
        "eval-every = 2\neval-fraction = 0.2\n"
    )
    common = ["train", "--config", str(config), "--checkpoint", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    r = shardlm(*common, "--steps", "3", "--plot", str(tmp_path), "--save", str(tmp_path / "trained"))
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    steps = [x for x in records if "loss" in x]
    assert [s["step"] for s in steps] == [1, 2, 3]  # the command line's --steps over the file's
    # the held-out tail (a fifth of the text: 2 batches of 2 x 16 tokens) after step 2 and at the end
    evals = [x for x in records if "eval_loss" in x]
    assert [(e["step"], e["eval_tokens"]) for e in evals] == [(2, 64), (3, 64)]
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"] and "eval after step 3: loss" in r.stderr
    assert all(s["tokens"] == 2 * 16 for s in steps)
    # torchtitan's warm-up (1/2 of lr), then cosine over the 2 steps left: 1, then 0.5
    assert [s["lr"] for s in steps] == pytest.approx([1e-4, 2e-4, 1e-4], rel=1e-12)
    # repeated text: three steps on it make the next windows more likely (measured 4.9 -> 1.3)
    assert steps[-1]["loss"] < 0.8 * steps[0]["loss"], steps
    line = next(x for x in r.stderr.splitlines() if "step 3/3  loss" in x)
    assert "tok/s" in line and ("MFU" in line or "TFLOP/s per rank" in line) and "(heaviest rank)" in line
    assert "cp=2 ring" in r.stderr
    # --checkpoint: the state after step 3 (the last); the same command for 4 steps runs only the 4th,
    # the cosine now over 3 steps after the warm-up: step 4 is 2/3 of the way (0.25 of lr)
    again = shardlm(*common, "--steps", "4")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and "after step 3" in again.stderr
    resumed = [x for x in map(json.loads, again.stdout.splitlines()) if "loss" in x]
    assert [s["step"] for s in resumed] == [4] and resumed[0]["lr"] == pytest.approx(0.5e-4, rel=1e-12)
    other = shardlm(*common, "--steps", "5", "--seed", "1")  # another data order: refused before any rank starts
    assert other.returncode == 2 and "resume with the same --data, --seq-len, --batch-size and --seed" in other.stderr
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    # the saved GGUF model is a HF directory: config, weights, and the same tokenizer and chat template
    from shardlm.models.loader import open_checkpoint
    from shardlm.models.tokenizer import Tokenizer

    saved, source = open_checkpoint(tmp_path / "trained"), open_checkpoint("smollm2")
    assert saved.kind == "hf" and saved.config.to_hf() == source.config.to_hf()
    mine, theirs = Tokenizer.from_pretrained(tmp_path / "trained"), source.tokenizer()
    chat = [{"role": "user", "content": "Explain ZeRO-3 in one line."}]
    assert mine.encode_chat(chat) == theirs.encode_chat(chat)
    # and its weights are HF's own reading of the GGUF (q/k un-permuted), moved by 3 steps of lr 1e-4
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "trained" / "model.safetensors")
    reference = dict(hf_smollm2.named_parameters())
    assert trained.keys() == reference.keys()
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.mlp.down_proj.weight",
    ):
        moved = (trained[name] - reference[name]).abs().max().item()
        assert 0 < moved < 1e-3, (name, moved)  # Adam moves a weight at most ~lr a step: 4e-4 in all


@pytest.mark.parametrize(
    "args,message",
    [
        (["--data", "missing.txt"], "--data 'missing.txt' is not a file"),
        (["--checkpoint-every", "0"], "--checkpoint-every 0 must be at least 1"),
        (["--tp", "2"], "query group over two ranks (9 query heads, 3 KV heads)"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--batch-size", "4000"], "fewer than one batch of 4000"),
        (["--cp", "3", "--seq-len", "16"], "seq_len=16 does not split into 2 x cp = 6 equal chunks"),
        (["--pp", "40"], "pp=40 needs at least one layer per stage but the model has 30 layers"),
        (
            ["--pp", "2", "--vpp", "2", "--grad-accum", "2"],
            "30 layers do not split into pp x vpp = 4 equal chunks; use vpp in [3, 5, 15]",
        ),
        (["--pp", "2", "--vpp", "3", "--grad-accum", "3"], "grad_accum=3 is not a multiple of 2 (use 2 or 4)"),
        (["--vpp", "2"], "pp=1 has none to interleave"),
        (["--pp", "2", "--pp-schedule", "zb-h1", "--vpp", "3"], "use --pp-schedule interleaved, or vpp=1"),
        (["--prefetch", "-2"], "prefetch=-2 must be a whole number of layers >= 0"),
        (["--bucket-mb", "-1"], "bucket_mb=-1.0 must be >= 0 MiB"),
        (
            ["--tp", "3", "--sequence-parallel", "--batch-size", "1", "--seq-len", "16"],
            "splits a micro-batch's 16 tokens on a rank over tp=3 evenly",
        ),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message, tmp_path, capsys):
    """Caught before any rank starts: checked in this process (``main_exit``; the real
    command's exit path is test_cli's)."""
    data = tmp_path / "data.txt"
    data.write_text("a few words of text " * 50)
    code, err = main_exit(["train", "--data", str(data), *args], capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and message in err, err

"""The pipeline schedules' orders (parallel/schedules.py) against their definitions, and ZB-H1's
split backward (train/schedule.py) against one whole backward."""

from __future__ import annotations

import pytest
import torch

from shardlm.errors import UsageError
from shardlm.parallel.schedules import check_schedule, in_flight, stage_orders, virtual_stage_layers
from shardlm.plan.schedule import simulate

SIZES = [(1, 3, 1), (2, 4, 1), (3, 3, 1), (4, 8, 1), (4, 2, 1), (3, 7, 1), (2, 4, 3), (3, 6, 2), (4, 8, 2), (2, 2, 4)]


def _cases():
    for p, m, v in SIZES:
        if v > 1:
            if p > 1:
                yield "interleaved", p, m, v
            continue
        for schedule in ("gpipe", "1f1b", "zb-h1"):
            yield schedule, p, m, 1


@pytest.mark.parametrize("schedule,p,m,v", list(_cases()))
def test_every_pass_once_in_dependency_order(schedule, p, m, v):
    orders = stage_orders(schedule, p, m, v)
    kinds = "FBW" if schedule == "zb-h1" else "FB"
    for order in orders:
        assert sorted(order) == sorted((k, i, c) for k in kinds for i in range(m) for c in range(v))
        for k, i, c in order:  # on a stage: F before B before W of the same micro-batch chunk
            if k != "F":
                assert order.index((kinds[kinds.index(k) - 1], i, c)) < order.index((k, i, c))
    simulate(schedule, stages=p, micro=m, virtual=v, t_f=1.0, t_b=1.0, t_w=1.0)  # raises on a deadlock


@pytest.mark.parametrize("schedule,p,m,v", list(_cases()))
def test_messages_between_two_stages_are_sent_and_received_in_one_order(schedule, p, m, v):
    """On an ordered transport (NCCL) the k-th message a stage receives from a peer must be the
    k-th that peer sent it: the hidden states of F go to the next virtual stage, the gradients
    of B to the previous one (with p = 2 both travel between the same two ranks)."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    last = p * v - 1
    for s, order in enumerate(stage_orders(schedule, p, m, v)):
        for kind, i, c in order:
            vs = c * p + s
            if kind == "F":
                if vs > 0:
                    received.setdefault(((s - 1) % p, s), []).append(("F", i, vs - 1))
                if vs < last:
                    sent.setdefault((s, (s + 1) % p), []).append(("F", i, vs))
            elif kind == "B":
                if vs < last:
                    received.setdefault(((s + 1) % p, s), []).append(("B", i, vs + 1))
                if vs > 0:
                    sent.setdefault((s, (s - 1) % p), []).append(("B", i, vs))
    assert sent == received


@pytest.mark.parametrize("p,m", [(4, 6), (4, 2), (1, 3), (3, 3), (4, 8)])
def test_activations_in_flight_per_schedule(p, m):
    """1F1B: stage s holds at most p - s micro-batches (GPipe: all m); ZB-H1 frees them at W and
    holds at most p, 1F1B's first stage's peak (Qi et al. §3.1)."""
    assert [in_flight(o) for o in stage_orders("1f1b", p, m)] == [min(p - s, m) for s in range(p)]
    assert [in_flight(o) for o in stage_orders("gpipe", p, m)] == [m] * p
    assert max(in_flight(o) for o in stage_orders("zb-h1", p, m)) == min(p, m)
    assert stage_orders("1f1b", 4, 6)[0] == [
        ("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("F", 3, 0), ("B", 0, 0), ("F", 4, 0),
        ("B", 1, 0), ("F", 5, 0), ("B", 2, 0), ("B", 3, 0), ("B", 4, 0), ("B", 5, 0),
    ]  # fmt: skip


def test_zb_h1_defers_w_on_later_stages():
    """Stage s warms up with p - s forwards and defers its first s weight gradients (Qi et al.'s
    figure 3: the last stage runs B before any W)."""
    orders = stage_orders("zb-h1", 4, 8)
    text = [" ".join(f"{k}{i}" for k, i, _ in o) for o in orders]
    assert text[0].startswith("F0 F1 F2 F3 B0 W0 F4 B1 W1")
    assert text[3].startswith("F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1")
    assert text[3].endswith("F7 B7 W4 W5 W6 W7")


def test_interleaved_chunks_and_bubble():
    assert virtual_stage_layers(12, 2, 3, 1) == [range(2, 4), range(6, 8), range(10, 12)]
    p, m, v = 4, 8, 2
    tl = simulate("interleaved", stages=p, micro=m, virtual=v, t_f=1.0, t_b=2.0)
    assert tl.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize(
    "args,message",
    [
        (("pipedream", 2, 4), "unknown; use one of 1f1b, gpipe, interleaved, zb-h1"),
        (("interleaved", 2, 3, 2), "grad_accum=3 is not a multiple of 2 (use 2 or 4)"),
        (("interleaved", 2, 4, 1), "give vpp >= 2"),
        (("interleaved", 1, 4, 2), "pp=1 has none to interleave"),
        (("1f1b", 2, 4, 2), "use --pp-schedule interleaved, or vpp=1"),
        (
            ("interleaved", 2, 4, 2, 6),
            "the model's 6 layers do not split into pp x vpp = 4 equal chunks; use vpp in [3]",
        ),
        (("1f1b", 2, 4, 0), "must be a positive integer"),
    ],
)
def test_bad_schedules_are_refused_in_one_line(args, message):
    with pytest.raises(
        UsageError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    ):
        check_schedule(*args)


class _Chunk(torch.nn.Module):
    """A weight used twice (two branch points into one weight) and one used once."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(4, 4, generator=g) / 2)
        self.u = torch.nn.Parameter(torch.randn(4, 4, generator=g) / 2)

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.w) @ self.w) @ self.u


def test_zb_split_backward_equals_one_backward_and_defers_the_weights():
    from torch.distributed.pipelining._backward import stage_backward_input

    from shardlm.train.schedule import weight_gradients

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad_out = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    whole = _Chunk()
    whole(x).backward(grad_out)
    want = {n: p.grad.clone() for n, p in whole.named_parameters()}
    want_x, x.grad = x.grad.clone(), None

    split = _Chunk()
    seen = []
    for name, p in split.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
    dx, groups = stage_backward_input([split(x)], [grad_out], [x], list(split.parameters()))
    torch.testing.assert_close(dx[0], want_x)
    assert all(p.grad is None for p in split.parameters())  # B computed no weight gradient
    weight_gradients(groups)
    for name, p in split.named_parameters():
        torch.testing.assert_close(p.grad, want[name], msg=name)
    assert sorted(seen) == ["u", "w"]  # accumulated once each, where ZeRO's hooks see it

"""SamplingParams validation and the sampler (greedy, temperature, top-k, top-p, seeds).

Statistical tests draw n samples with a fixed seed, so they are deterministic (never
flaky); the tolerances are still chosen as if they were random: each observed
frequency must lie within 5 standard errors, 5 * sqrt(p (1 - p) / n), of its
expected probability (a two-sided 5-sigma bound, ~6e-7 chance per cell for a correct
sampler with a fresh seed).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardlm.engine.sampling import SamplingParams, sample
from shardlm.errors import UsageError


def draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n draws from one row of logits with one seeded generator; returns counts per token."""
    gen = torch.Generator().manual_seed(seed)
    rows = logits.unsqueeze(0).expand(n, -1)
    tokens = sample(rows, [params] * n, [gen] * n)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel())


def assert_freqs_match(counts: torch.Tensor, probs: torch.Tensor) -> None:
    n = int(counts.sum())
    freq = counts.double() / n
    p = probs.double()
    tol = 5 * torch.sqrt(p * (1 - p) / n)
    err = (freq - p).abs()
    assert bool((err <= tol + 1e-12).all()), f"freq {freq.tolist()}\nwant {p.tolist()}\nerr {err.tolist()}"


# ---- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,bad",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", "8"),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", -math.inf),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", float("nan")),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_k", "5"),
    ],
)
def test_bad_params_raise_usage_error_naming_the_field(field, bad):
    with pytest.raises(UsageError) as err:
        SamplingParams(**{field: bad})
    assert f"{field}={bad!r}" in str(err.value), str(err.value)


@pytest.mark.parametrize("field,bad", [("temperature", "0.7"), ("top_p", "0.9"), ("top_p", None)])
def test_non_numeric_float_params_raise_usage_error(field, bad):
    with pytest.raises(UsageError, match=field):
        SamplingParams(**{field: bad})


def test_good_params_are_accepted():
    # can-fail guard for the validation tests: the boundaries themselves are valid
    p = SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0)
    assert p.greedy
    q = SamplingParams(max_tokens=4096, temperature=1.5, top_p=1e-6, top_k=1, seed=3, stop_token_ids=(1, 2))
    assert not q.greedy
    with pytest.raises(TypeError):
        SamplingParams(64)  # type: ignore[misc]  # keyword-only


# ---- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, 33, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1).tolist()
    assert len(set(want)) > 1  # rows disagree, so a row mix-up would show
    got = sample(logits, [SamplingParams()] * 6, [None] * 6)
    assert got == want


def test_greedy_and_sampled_rows_mix():
    # row 0 greedy, row 1 sampled from a flat distribution over tokens 0..2 (the rest -inf-ish)
    logits = torch.cat([torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]]), torch.full((2, 97), -1e9)], dim=1)
    params = [SamplingParams(), SamplingParams(temperature=1.0)]
    gen = torch.Generator().manual_seed(0)
    outs = [sample(logits, params, [None, gen]) for _ in range(60)]
    assert all(o[0] == 1 for o in outs)  # the greedy row never samples
    assert {o[1] for o in outs} == {0, 1, 2}  # the sampled row does, within its support


# ---- top-k --------------------------------------------------------------------------


def test_top_k_keeps_exactly_the_k_most_likely():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, generator=g) * 0.5  # flat-ish: all top-8 tokens are likely enough
    k = 8
    counts = draw(logits, SamplingParams(temperature=1.0, top_k=k), n=4000)
    support = set(torch.nonzero(counts).flatten().tolist())
    top = set(torch.topk(logits, k).indices.tolist())
    assert support == top  # only the top k, and all of them (each has p > 5%)
    # and their frequencies are the softmax renormalised over the top k
    probs = torch.zeros_like(logits)
    idx = torch.tensor(sorted(top))
    probs[idx] = torch.softmax(logits[idx], 0)
    assert_freqs_match(counts, probs)
    # can-fail guard: without top_k the support is wider
    wide = draw(logits, SamplingParams(temperature=1.0), n=4000)
    assert len(torch.nonzero(wide)) > k


# ---- top-p --------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.4, 0.3, 0.2, 0.1 in shuffled positions
    probs = torch.tensor([0.1, 0.3, 0.4, 0.2])
    logits = probs.log()
    cases = {
        0.05: {2},  # the top token always stays
        0.39: {2},  # 0.4 already reaches 0.39
        0.5: {2, 1},  # 0.4 < 0.5 <= 0.7
        0.69: {2, 1},
        0.8: {2, 1, 3},  # 0.7 < 0.8 <= 0.9
        0.95: {0, 1, 2, 3},  # 0.9 < 0.95
    }
    for top_p, keep in cases.items():
        counts = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), n=2000, seed=int(top_p * 100))
        support = set(torch.nonzero(counts).flatten().tolist())
        assert support == keep, (top_p, support)
        want = torch.zeros(4)
        idx = torch.tensor(sorted(keep))
        want[idx] = probs[idx] / probs[idx].sum()
        assert_freqs_match(counts, want)


def test_top_k_then_top_p():
    # top_k=3 keeps 0.4, 0.3, 0.2 -> renormalised 4/9, 3/9, 2/9; top_p=0.6 then keeps 4/9 + 3/9
    probs = torch.tensor([0.1, 0.3, 0.4, 0.2])
    counts = draw(probs.log(), SamplingParams(temperature=1.0, top_k=3, top_p=0.6), n=3000)
    assert set(torch.nonzero(counts).flatten().tolist()) == {1, 2}
    assert_freqs_match(counts, torch.tensor([0.0, 3 / 7, 4 / 7, 0.0]))


# ---- seeds --------------------------------------------------------------------------


def test_same_seed_same_draws_different_seed_different_draws():
    flat = torch.zeros(1000)
    p = SamplingParams(temperature=1.0)

    def tokens(seed):
        gen = torch.Generator().manual_seed(seed)
        return [sample(flat[None], [p], [gen])[0] for _ in range(20)]

    a, b, c = tokens(123), tokens(123), tokens(124)
    assert a == b
    assert a != c  # 20 draws over 1000 tokens: equal by chance with probability 1e-60
    assert len(set(a)) > 10  # the draws do vary within one stream


# ---- temperature --------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    n = 20_000
    counts = draw(logits, SamplingParams(temperature=temperature), n=n, seed=7)
    want = torch.softmax(logits / temperature, 0)
    assert_freqs_match(counts, want)
    # can-fail guard: a sampler ignoring the temperature would miss by far more than the
    # tolerance
    other = torch.softmax(logits / (temperature * 2), 0)
    freq = counts.double() / n
    assert (freq - other.double()).abs().max() > 10 * math.sqrt(0.25 / n)

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

from shardlm.engine.sampling import SamplingParams, logprobs_of, probabilities, process, processes, sample
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


def test_defaults_are_vllms():
    """A vLLM user's SamplingParams() samples (temperature 1) and stops after 16 tokens."""
    p = SamplingParams()
    assert (p.temperature, p.max_tokens, p.top_p, p.top_k, p.n) == (1.0, 16, 1.0, 0, 1) and not p.greedy


# ---- greedy -------------------------------------------------------------------------


def test_greedy_is_argmax_per_row():
    logits = torch.randn(6, 33, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1).tolist()
    assert len(set(want)) > 1  # rows disagree, so a row mix-up would show
    got = sample(logits, [SamplingParams(temperature=0.0)] * 6, [None] * 6)
    assert got == want


def test_greedy_and_sampled_rows_mix():
    # row 0 greedy, row 1 sampled from a flat distribution over tokens 0..2 (the rest -inf-ish)
    logits = torch.cat([torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]]), torch.full((2, 97), -1e9)], dim=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)]
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


# ---- logits processors: each against its formula, written out here ---------------------


def reference_process(logits, p, prompt, output, stop_ids):
    """vLLM's order, one token at a time: logit_bias, min_tokens, repetition, then frequency
    and presence (OpenAI's formula)."""
    out = [float(x) for x in logits]
    for t, b in p.logit_bias.items():
        out[t] += b
    if len(output) < p.min_tokens:
        for t in stop_ids:
            out[t] = -math.inf
    for t in range(len(out)):
        if t in prompt or t in output:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return torch.tensor(out)


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.5),
        dict(frequency_penalty=0.8),
        dict(presence_penalty=-1.2),
        dict(logit_bias={3: 5.0, 7: -100}),
        dict(min_tokens=6),  # the output holds 5: stop tokens masked
        dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.25, logit_bias={1: 2.0}, min_tokens=4),
    ],
)
def test_process_equals_formula(kw):
    logits = torch.randn(12, generator=torch.Generator().manual_seed(3)) * 3
    p = SamplingParams(**kw)
    prompt, output, stops = [1, 2, 2, 9], [4, 4, 4, 2, 11], frozenset({0, 5})
    assert processes(p)
    got = process(logits, p, prompt, output, stops)
    want = reference_process(logits, p, prompt, output, stops)
    torch.testing.assert_close(got, want)
    assert not torch.equal(got, logits)  # can fail: each setting changes some logit


def test_min_tokens_lifts_after_enough_tokens():
    logits = torch.zeros(6)
    p = SamplingParams(min_tokens=2)
    assert process(logits, p, [1], [3], frozenset({0}))[0] == -math.inf
    assert process(logits, p, [1], [3, 4], frozenset({0}))[0] == 0


def test_no_processor_is_a_no_op():
    assert not processes(SamplingParams(temperature=0.5, top_k=3, min_p=0.1))


def test_min_p_drops_tokens_below_the_fraction_of_the_top():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])  # min_p 0.2: keep p >= 0.1
    kept = probabilities(probs.log(), SamplingParams(temperature=1.0, min_p=0.2))
    torch.testing.assert_close(kept, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)


def test_logprobs_of_is_log_softmax_with_rank_and_top_k():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5])
    lp = torch.log_softmax(logits, 0)
    e = logprobs_of(logits, 3, 2)
    assert e.logprob == pytest.approx(lp[3].item()) and e.rank == 2
    assert [i for i, _ in e.top] == [1, 3] and e.top[0][1] == pytest.approx(lp[1].item())
    assert logprobs_of(logits, 2, 0).top == () and logprobs_of(logits, 2, 0).rank == 4


@pytest.mark.parametrize(
    "field,bad",
    [
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("n", 0),
        ("logit_bias", {1: 101}),
        ("logit_bias", {-1: 1.0}),
        ("stop", 5),
    ],
)
def test_bad_processor_params_are_refused(field, bad):
    with pytest.raises(UsageError, match=field if field != "logit_bias" else "logit_bias"):
        SamplingParams(**{field: bad})


def test_stop_takes_a_string_or_a_list():
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "", "b"]).stop == ("a", "b")


def test_greedy_tokens_take_the_first_of_ties_as_torch_does():
    """numpy's argmax (CPU float32) and torch's (the rest) agree with torch's max: the first of
    ties, the first NaN, -0 equal to 0, a row of -inf at 0."""
    from shardlm.engine.sampling import greedy_tokens

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1, 3, 3, nan, nan], [0, -0.0, 0, -1, -1], [-inf] * 5, [-0.0, 0, 0, 0, 0], [1, 2, 5, 5, 0]])
    want = rows.max(dim=-1).indices.tolist()
    assert greedy_tokens(rows) == want == [3, 0, 0, 0, 2]
    assert greedy_tokens(rows.to(torch.bfloat16)) == want
    assert greedy_tokens(rows.t().contiguous().t()) == want  # not contiguous

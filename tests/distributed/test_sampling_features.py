"""Logprobs, n > 1 choices and the logits processors through the engine, against HF.

References: logprobs are ``log_softmax`` of HF's logits at each generated token's position
(tolerance 1e-4: float32 logits of this size differ by ~1e-5 between reduction orders; the
top-k sets must be equal). Processors: HF's own logits processors where HF has them
(``repetition_penalty``, ``sequence_bias``, ``min_new_tokens``), else a greedy loop over
HF's logits with the formula written out here (frequency and presence penalties).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.reference import NEW_TOKENS, PROMPTS
from shardlm import LLM, SamplingParams

LOGPROB_ATOL = 1e-4
TOP = 5


@pytest.fixture(scope="module")
def hf_llama(tiny):
    from transformers import AutoModelForCausalLM

    ref = tiny("llama")
    return ref, AutoModelForCausalLM.from_pretrained(ref.path).eval()


def hf_log_softmax(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), vocab]: HF's log-probabilities at each generated token's position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)


def check_logprobs(model, prompt, out, k: int) -> None:
    choice = out.outputs[0]
    want = hf_log_softmax(model, prompt, choice.token_ids)
    assert len(choice.logprobs) == len(choice.token_ids)
    for pos, (token, entry) in enumerate(zip(choice.token_ids, choice.logprobs)):
        row = want[pos]
        assert abs(entry[token].logprob - row[token].item()) < LOGPROB_ATOL, (pos, entry[token], row[token])
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k)
        assert set(entry) - {token} <= set(top.indices.tolist())  # the dict: the token and the top k
        assert set(top.indices.tolist()) <= set(entry)
        for i, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[i].logprob - v) < LOGPROB_ATOL
    assert choice.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(choice.token_ids, choice.logprobs))
    )


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param({}, id="tp1"),
        pytest.param(dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}), id="ngram"),
        pytest.param(dict(tp=2), id="tp2"),
        pytest.param(dict(pp=2), id="pp2"),
        pytest.param(dict(dp=2), id="dp2"),
    ],
)
def test_logprobs_equal_hf_log_softmax(hf_llama, layout):
    ref, model = hf_llama
    prompts = PROMPTS[1:]
    with LLM(str(ref.path), threads=1, **layout) as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP))
        sampled = llm.generate(prompts[:1], SamplingParams(max_tokens=12, logprobs=0, temperature=1.0, seed=5))
    for prompt, out, want in zip(prompts, greedy, ref.tokens[1:]):
        assert out.token_ids == want
        check_logprobs(model, prompt, out, TOP)
        assert all(e[t].rank == 1 for t, e in zip(out.token_ids, out.outputs[0].logprobs))  # greedy: the argmax
    check_logprobs(model, prompts[0], sampled[0], 0)  # sampled tokens: their own logprob only (logprobs=0)
    assert any(e[t].rank > 1 for t, e in zip(sampled[0].token_ids, sampled[0].outputs[0].logprobs))


def test_no_logprobs_unless_asked(hf_llama):
    ref, _ = hf_llama
    out = (
        LLM(str(ref.path), threads=1).generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    )
    assert out.logprobs is None and out.cumulative_logprob is None


def test_n_choices_are_seeded_distinct_and_share_the_prompt(hf_llama):
    ref, _ = hf_llama
    prompt = PROMPTS[3]  # 33 tokens: 8 full blocks of 4
    llm = LLM(str(ref.path), threads=1, block_size=4)
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7)
    blocks = llm.worker.engine.blocks
    hits = blocks.hits
    first = llm.generate([prompt], params)[0]
    assert blocks.hits - hits == 3 * 32  # the three later choices found the prompt's 8 full blocks
    again = llm.generate([prompt], params)[0]
    choices = [c.token_ids for c in first.outputs]
    assert [c.index for c in first.outputs] == [0, 1, 2, 3]
    assert choices == [c.token_ids for c in again.outputs]  # reproducible
    assert len({tuple(c) for c in choices}) == 4  # and different from each other
    # choice j is the request with seed 7 + j
    alone = llm.generate([prompt] * 4, [SamplingParams(max_tokens=12, temperature=1.0, seed=7 + j) for j in range(4)])
    assert [o.token_ids for o in alone] == choices


def test_n_choices_across_replicas_and_stages(hf_llama):
    ref, _ = hf_llama
    params = SamplingParams(n=3, max_tokens=10, temperature=1.0, seed=11)
    with LLM(str(ref.path), threads=1, block_size=4) as one:
        want = [[c.token_ids for c in o.outputs] for o in one.generate(PROMPTS[1:3], params)]
    with LLM(str(ref.path), threads=1, block_size=4, dp=2, pp=2) as llm:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS[1:3], params)]
    assert got == want


# ---- logits processors: greedy tokens equal HF's (or the formula's) ------------------------


def hf_generate(model, prompt, n, **kw) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw)
    return out[0, len(prompt) :].tolist()


def formula_greedy(model, prompt, n, *, frequency: float, presence: float) -> list[int]:
    """Greedy decoding over HF's logits with OpenAI's penalties written out:
    logit[t] -= frequency * count(t in output) + presence * (count > 0)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            out.append(int(logits.argmax()))
    return out


@pytest.mark.parametrize(
    "params,hf_kw",
    [
        pytest.param(dict(repetition_penalty=1.8), dict(repetition_penalty=1.8), id="repetition"),
        pytest.param(dict(repetition_penalty=0.7), dict(repetition_penalty=0.7), id="repetition<1"),
        pytest.param(
            dict(logit_bias={17: 6.0, 3: -100.0}), dict(sequence_bias={(17,): 6.0, (3,): -100.0}), id="logit_bias"
        ),
    ],
)
def test_processors_equal_hf(hf_llama, params, hf_kw):
    ref, model = hf_llama
    prompts = PROMPTS[1:3]
    out = LLM(str(ref.path), threads=1).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, **params)
    )
    wants = [hf_generate(model, prompt, NEW_TOKENS, **hf_kw) for prompt in prompts]
    assert [o.token_ids for o in out] == wants
    assert wants != ref.tokens[1:3]  # can fail: the processor changes these tokens


def test_frequency_and_presence_penalties_equal_the_formula(hf_llama):
    ref, model = hf_llama
    prompt = PROMPTS[2]
    llm = LLM(str(ref.path), threads=1)
    for frequency, presence in [(1.5, 0.0), (0.0, 2.0), (0.7, -0.5)]:
        params = SamplingParams(
            temperature=0.0, max_tokens=NEW_TOKENS, frequency_penalty=frequency, presence_penalty=presence
        )
        got = llm.generate(prompt, params)[0].token_ids
        assert got == formula_greedy(model, prompt, NEW_TOKENS, frequency=frequency, presence=presence)
    assert got != ref.tokens[2]  # can fail: the penalties change the tokens


def test_min_tokens_masks_stop_tokens_as_hf_min_new_tokens(hf_llama):
    ref, model = hf_llama
    prompt, plain = PROMPTS[1], ref.tokens[1]
    stop = plain[3]  # without min_tokens the answer ends at its fourth token
    assert stop not in plain[:3]
    llm = LLM(str(ref.path), threads=1)
    short = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(stop,)))[0]
    assert short.token_ids == plain[:4] and short.outputs[0].stop_reason == stop
    long = llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(stop,), min_tokens=10)
    )[0]
    want = hf_generate(model, prompt, NEW_TOKENS, eos_token_id=stop, min_new_tokens=10)
    assert long.token_ids == want and len(want) > 10
    assert stop not in long.token_ids[:10]


def test_min_p_keeps_tokens_above_the_fraction_of_the_top(hf_llama):
    ref, model = hf_llama
    prompt = PROMPTS[1]
    llm = LLM(str(ref.path), threads=1)
    params = SamplingParams(max_tokens=1, temperature=1.0, min_p=0.2, logprobs=0)
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    allowed = set(torch.nonzero(probs >= 0.2 * probs.max()).flatten().tolist())
    assert 1 < len(allowed) < 20
    seen = {llm.generate(prompt, dataclasses.replace(params, seed=s))[0].token_ids[0] for s in range(40)}
    assert seen <= allowed and len(seen) > 1


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(max_num_batched_tokens=8), id="chunked"),
        pytest.param(dict(pp=2, max_num_batched_tokens=8), id="pp2"),
        pytest.param(dict(tp=2, dp=2), id="dp2xtp2", marks=pytest.mark.slow),  # ~7 s: make test's budget
        pytest.param(dict(cp=2, max_num_batched_tokens=8), id="cp2"),  # scored rows gathered from both ranks
    ],
)
def test_prompt_logprobs_equal_hf_log_softmax(hf_llama, layout):
    """Every prompt token after the first, scored in chunks of 8 (the prompt of 33 spans five
    steps), through the pipeline's token message, and again for a repeat of the prompt whose
    blocks sit in the prefix cache (a scored prompt is computed whole)."""
    ref, model = hf_llama
    prompts = [PROMPTS[3], PROMPTS[2], PROMPTS[3]]
    with LLM(str(ref.path), threads=1, block_size=4, **layout) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=TOP))
        again = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))[0]
    for prompt, out in [*zip(prompts, outs), (prompts[0], again)]:
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        scored = out.prompt_logprobs
        assert scored[0] is None and len(scored) == len(prompt)
        for q in range(1, len(prompt)):
            entry, row = scored[q], want[q - 1]
            assert abs(entry[prompt[q]].logprob - row[prompt[q]].item()) < LOGPROB_ATOL
            assert entry[prompt[q]].rank == int((row > row[prompt[q]]).sum()) + 1
            top = torch.topk(row, TOP).indices.tolist() if out is not again else []
            assert set(top) <= set(entry)
        assert out.token_ids == ref.tokens[PROMPTS.index(prompt)][:4]  # sampling goes on as ever


def test_best_of_keeps_the_n_most_likely(hf_llama):
    ref, _ = hf_llama
    prompt = PROMPTS[2]
    with LLM(str(ref.path), threads=1) as llm:
        every = llm.generate(prompt, SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=9, logprobs=0))[0]
        best = llm.generate(prompt, SamplingParams(n=2, best_of=4, max_tokens=8, temperature=1.0, seed=9))[0]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked[:2]]
    assert [c.token_ids for c in ranked[:2]] != [c.token_ids for c in every.outputs[:2]]  # can fail: not the first two
    assert best.outputs[0].logprobs is None  # not asked for

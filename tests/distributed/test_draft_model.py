"""Speculative decoding with a draft model (engine/draft.py): a separate small model, or the
target's own first layers (layer_skip).

Greedy runs must give exactly plain decoding's tokens at every layout (the draft runs on the
sampling ranks, sharded over tp, and its drafts travel down the pipeline with the tokens);
sampled runs must keep the target distribution, checked on the verifier by Monte Carlo with the
draft's distribution q. A draft identical to the target must have every draft accepted, which
holds only if the draft's KV cache is rolled back to the accepted prefix after each step: the
test that would catch a stale draft cache. Each test also shows drafts were made and accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import llm_generate
from harness.reference import PROMPTS
from shardlm import LLM, SamplingParams
from shardlm.engine.sampling import probabilities
from shardlm.engine.speculative import SpeculativeConfig, verify
from shardlm.engine.structured import StructuredOutputsParams
from shardlm.errors import UsageError


def first_layers_copy(src: Path, dst: Path, layers: int) -> Path:
    """A HF directory holding ``src``'s first ``layers`` layers, its embedding, final norm and head:
    a small random draft with the target's vocabulary that agrees with it some of the time."""
    from safetensors.torch import load_file, save_file

    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(src / "model.safetensors")
    keep = {k: v for k, v in tensors.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def target(tiny):
    return tiny("llama")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory):
    return first_layers_copy(target.path, tmp_path_factory.mktemp("draft"), 2)


GREEDY = SamplingParams(temperature=0.0, max_tokens=100)


def test_sampled_verify_with_draft_distribution_keeps_the_target_distribution():
    """Draft x drawn from q, kept with probability min(1, p(x)/q(x)), else a draw from
    norm(max(0, p - q)): every emitted token is distributed as p, for a q close to p, one far
    from it, and one putting mass where p (after top-k) has none. 4000 seeded draws each, every
    token's frequency within 0.025 of p (3 standard errors at 0.5: 0.024)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 0.1, 0.3]])
    params = SamplingParams(temperature=0.8, top_k=4)
    p = probabilities(logits[0], params)
    n = 4000
    for q in (
        torch.softmax(torch.tensor([1.8, 1.1, 0.4, 0.1, -2.0]), 0),
        torch.tensor([0.05, 0.05, 0.1, 0.7, 0.1]),
        torch.tensor([0.1, 0.1, 0.1, 0.1, 0.6]),  # token 4 is outside p's top-k
    ):
        counts = torch.zeros(5)
        accepted = 0
        for _ in range(n):
            x = int(torch.multinomial(q, 1, generator=g))
            out = verify(logits, [x], params, g, q[None])
            counts[out[0]] += 1
            accepted += len(out) == 2
        torch.testing.assert_close(counts / n, p, atol=0.025, rtol=0)
        want = float(torch.minimum(p, q).sum())  # the acceptance rate the rule implies: sum min(p, q)
        assert abs(accepted / n - want) < 0.025, (accepted / n, want)
    # it can fail: taking the draft as it comes would give q, far from p
    assert (q - p).abs().max() > 0.3


def test_a_draft_equal_to_the_target_has_every_draft_accepted(target):
    """Draft = the target itself, 4-token blocks so that drafts run into new blocks and scratch
    ones: greedy tokens are plain decoding's and every draft is accepted, which needs the draft's
    cache to hold exactly the accepted tokens after each step (a stale slot changes its logits)."""
    plain = LLM(str(target.path), threads=1).generate(PROMPTS, GREEDY)
    spec = {"model": str(target.path), "num_speculative_tokens": 3}
    llm = LLM(str(target.path), threads=1, block_size=4, speculative_config=spec)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = llm.last_stats
    assert stats.draft_tokens == stats.accepted_tokens > 250, (stats.draft_tokens, stats.accepted_tokens)
    # sampled: q = p, so every draft is accepted there too
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=5))
    assert llm.last_stats.draft_tokens == llm.last_stats.accepted_tokens > 0


def test_the_draft_cache_rolls_back_to_the_accepted_prefix(draft):
    """Drafting rounds after steps that accepted 0..3 of the drafts and then a token of the target's
    own (which the draft did not propose): each round's drafts equal those of a fresh draft cache fed
    the whole history, so nothing a rejected draft wrote is read back. The sequence holds only the
    blocks for its computed tokens, so its last token and drafts land in scratch blocks."""
    from shardlm.engine.draft import Drafter
    from shardlm.engine.sequence import Sequence
    from shardlm.models.loader import load_model, open_checkpoint
    from shardlm.parallel.dims import ParallelDims

    model = load_model(open_checkpoint(draft), ParallelDims().build_mesh("cpu"))
    make = dict(k=3, num_blocks=32, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    drafter = Drafter(model, kv_dtype=torch.float32, max_num_seqs=2, **make)
    tokens = list(PROMPTS[3])
    seq = Sequence(0, tokens, SamplingParams(temperature=0.0))
    rejected = 0
    for accepted in [0, 1, 2, 3, 0, 2, 1, 0, 3, 1]:
        seq.block_table = list(range(-(-(len(tokens) - 1) // 4)))  # blocks for the computed tokens only
        drafter.propose([(seq, tokens, 3)])
        fresh = Sequence(1, tokens, SamplingParams(temperature=0.0))
        fresh.block_table = seq.block_table
        Drafter(model, kv_dtype=torch.float32, max_num_seqs=2, **make).propose([(fresh, tokens, 3)])
        assert seq.proposed == fresh.proposed, (len(tokens), seq.proposed, fresh.proposed)
        # the step: the first ``accepted`` drafts kept, then the target's own token (not the next draft)
        own = (seq.proposed[accepted] + 1) % 251 if accepted < 3 else 7
        rejected += accepted < 3
        tokens = tokens + seq.proposed[:accepted] + [own]
    assert rejected >= 5


def test_draft_model_and_layer_skip_give_plain_greedy_tokens(target, draft):
    """One process: a separate 2-layer draft and the target's first 2 layers (which share its
    weights) draft the same tokens, so their counts agree; both give plain greedy's tokens."""
    plain = LLM(str(target.path), threads=1).generate(PROMPTS, GREEDY)
    counts = []
    for spec in (
        {"model": str(draft), "num_speculative_tokens": 3},
        {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
    ):
        llm = LLM(str(target.path), threads=1, speculative_config=spec)
        out = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], spec
        assert [o.token_ids[:32] for o in out] == target.tokens  # HF's own greedy tokens
        counts.append((llm.last_stats.draft_tokens, llm.last_stats.accepted_tokens))
    assert counts[0] == counts[1] and counts[0][0] > counts[0][1] > 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(pp=2, tp=2)], ids=str)
def test_draft_model_layouts_give_plain_greedy_tokens(target, draft, layout):
    """tp=2 (the draft sharded like the target), pp=2 (the last stage drafts; layer_skip reads its
    own copy of the first layers there) and pp=2 x tp=2 = one process's plain greedy tokens."""
    n = [100] * len(PROMPTS)
    plain = LLM(str(target.path), threads=1).generate(PROMPTS, GREEDY)
    want = [o.token_ids for o in plain]
    world = layout.get("tp", 1) * layout.get("pp", 1)
    for spec in (
        {"model": str(draft), "num_speculative_tokens": 3},
        {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 3},
    ):
        for tokens, _ in run_ranks(
            world, llm_generate, str(target.path), PROMPTS, n, speculative_config=spec, **layout
        ):
            assert tokens == want, (layout, spec)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "draft_model"}, "model=None goes with method='draft_model'"),
        ({"method": "ngram", "model": "x"}, "model='x' goes with method='draft_model'"),
        ({"method": "layer_skip"}, "num_layers=None must be a positive integer"),
        ({"method": "layer_skip", "num_layers": 0}, "num_layers=0 must be a positive integer"),
        ({"model": "x", "num_layers": 2}, "num_layers=2 goes with method='layer_skip'"),
        ({"model": "x", "prompt_lookup_max": 3}, "prompt_lookup_max/min apply to method='ngram'"),
        ({"model": "x", "draft_tensor_parallel_size": 1}, r"unknown keys \['draft_tensor_parallel_size'\]"),
    ],
)
def test_bad_draft_config(config, match):
    from shardlm.engine.config import EngineConfig

    with pytest.raises(UsageError, match=match):
        EngineConfig(speculative_config=config)


def test_draft_model_method_is_inferred_from_model():
    assert SpeculativeConfig.of({"model": "x"}).method == "draft_model"
    assert SpeculativeConfig.of({}).method == "ngram"


def test_refused_drafts(target, draft, tmp_path):
    """Refused before any rank starts, each with the value and a fix (only a draft's config.json is
    read for these checks, so the variants are config files)."""

    def variant(name: str, **changes) -> str:
        config = json.loads((draft / "config.json").read_text())
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **changes}))
        return str(tmp_path / name)

    cases = [
        (
            dict(speculative_config={"model": variant("vocab", vocab_size=300)}),
            "vocabulary of 300 tokens and the target 251",
        ),
        (
            dict(speculative_config={"method": "layer_skip", "num_layers": 6}),
            "num_layers=6 must be below the target's 6",
        ),
        (
            dict(speculative_config={"model": variant("heads", num_attention_heads=2, num_key_value_heads=2)}, tp=3),
            "sharded like the target over tp=3: tp=3 is larger than the model's 2 attention heads",
        ),
        (dict(speculative_config={"model": str(draft)}, cp=2), "does not work with cp=2"),
        (
            dict(speculative_config={"model": variant("short", max_position_embeddings=128)}),
            "lower max_model_len to 128",
        ),
        (dict(speculative_config={"model": str(tmp_path / "none")}), "not found"),
    ]
    for options, match in cases:
        with pytest.raises(UsageError, match=match):
            LLM(str(target.path), threads=1, **options)
    structured = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=("a", "b")))
    llm = LLM(str(target.path), threads=1, speculative_config={"model": str(draft)})
    with pytest.raises(UsageError, match="structured outputs do not run with speculative decoding"):
        llm.generate([PROMPTS[1]], structured)

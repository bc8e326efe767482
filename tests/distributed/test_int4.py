"""Weight-only int4 (``quantization="int4"`` and ``"gguf"``): packed int4 linear layers.

* SmolLM2's GGUF (its linear layers are Q4_1): with quantization="gguf" each rank holds, for every
  linear layer, exactly its rows' blocks of the file (the codes packed, float16 d and m as the
  file stores them) and nothing else: its parameter bytes are the packed size plus the float
  parts (norms, the Q8_0 embedding dequantized). Greedy tokens at tp=2 and tp=3 = tp=1's up to a
  near tie: the same weights, only the partial sums' rounding differs, but each layer rounds its
  activations to int8 again (as llama.cpp does), so that rounding moves a logit by ~1 at most
  (``TIE``).
* A float checkpoint with quantization="int4" (a tiny Qwen3 whose every shard splits into groups of
  32): each rank's layers compute x @ W^T of their dequantized int4 weights within the kernel's
  rounding (activations rounded to int8 per group of 32), and the weights of tp=2 and tp=3 are tp=1's (groups never
  straddle the tp split); the logits' error against HF's float32 model is bounded as for int8.
"""

from __future__ import annotations

import pytest
import torch

from harness.multirank import run_ranks
from harness.rankfns import greedy_and_logits, greedy_top2, make_worker
from harness.reference import NEW_TOKENS, PROMPTS, SMOLLM2_QUESTIONS, build_tiny
from shardlm.errors import UsageError

TINY = dict(intermediate_size=192)  # qwen3: hidden 96, head_dim 32: every tp<=3 shard is whole groups


@pytest.fixture(scope="module")
def smollm2_q4():
    """(SmolLM2's Q4_1 GGUF, two chat prompts as ids); no HF reference needed here."""
    from shardlm.models.loader import open_checkpoint

    ckpt = open_checkpoint("smollm2")
    tok = ckpt.tokenizer()
    return str(ckpt.path), [tok.encode_chat([{"role": "user", "content": q}]) for q in SMOLLM2_QUESTIONS[:2]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_tiny("qwen3", tmp_path_factory.mktemp("qwen3_int4"), **TINY)


def held_vs_file(model: str, tp: int):
    """On this rank: for every column- and row-parallel layer, whether its packed weight and
    scales are the file's blocks for its rows/columns, and (bytes held, packed bytes expected)."""
    from shardlm.models.loader import GGUFSource
    from shardlm.parallel.int4 import INT4_GROUP, pack_int4
    from shardlm.parallel.tensor import ColumnParallelLinear, Int8Weight

    worker = make_worker(model, tp, quantization="gguf")
    src = GGUFSource(worker.checkpoint.source().gguf, worker.checkpoint.config)
    same, held, expected, layers = True, 0, 0, 0
    for m in worker.model.modules():
        if not isinstance(m, Int8Weight):
            continue
        if isinstance(m, ColumnParallelLinear):
            parts = [src.read_int4(f"{n}.weight", rows=r) for n, r in m.sources]
        else:
            parts = [src.read_int4(f"{m.source}.weight", cols=m.cols)]
        q = torch.cat([p.q for p in parts])
        packed, sz = pack_int4(type(parts[0]).cat(parts))
        assert m.weight_scale is not None
        same &= torch.equal(m.weight, packed) and torch.equal(m.weight_scale, sz) and m.weight.dtype == torch.uint8
        held += m.weight.numel() * m.weight.element_size() + m.weight_scale.numel() * m.weight_scale.element_size()
        expected += q.numel() // 2 + q.numel() // INT4_GROUP * 2 * 2  # two codes a byte; float16 scale and offset
        layers += 1
    return same, held, expected, layers, worker.model.param_bytes()


@pytest.mark.slow  # ~25 s
def test_gguf_q4_1_weights_are_held_as_the_files_blocks(smollm2_q4):
    """At tp=1 and tp=2 (one test: tp=2's comparison needs tp=1's bytes anyway)."""
    path, _ = smollm2_q4
    [single] = run_ranks(1, held_vs_file, path, 1)
    pair = run_ranks(2, held_vs_file, path, 2)
    for tp, results in ((1, [single]), (2, pair)):
        for rank, (same, held, expected, layers, _) in enumerate(results):
            assert layers == 30 * 4, f"rank {rank}: {layers} packed layers"  # qkv, o, gate/up, down per layer
            assert same, f"rank {rank} of tp={tp} holds weights other than the file's blocks"
            assert held == expected, f"rank {rank}: {held} bytes held for {expected} packed"
    # at tp=2 each rank holds about half (a KV head whose query group spans both ranks is on both)
    whole = single[1]
    assert all(h < 0.55 * whole for _, h, _, _, _ in pair), [h / whole for _, h, _, _, _ in pair]


# Where the greedy tokens of two layouts may part: at a step whose two most likely tokens are
# within TIE nats in both. Why a tie can part them: a float sum's rounding (1e-7 relative) moves an
# activation across an int8 rounding boundary now and then, and 30 layers of that move SmolLM2's
# logits by ~0.9 at most at a step (median over a 40-token answer; the same between the kernel's
# tp=1 and tp=2 as between two builds of it at tp=1), the top two by less.
TIE = 0.25


def assert_same_up_to_a_near_tie(got, want, what: str):
    """Per prompt: the same tokens, or the same up to a step where the two runs pick each other's
    runner-up, within TIE of their own pick."""
    for p, (a, b) in enumerate(zip(got, want)):
        part = next((j for j, (x, y) in enumerate(zip(a, b)) if x[0] != y[0]), None)
        if part is None:
            assert len(a) == len(b), (what, p)
            continue
        for (token, top), other in ((a[part][0], a[part][1]), b[part][0]), ((b[part][0], b[part][1]), a[part][0]):
            (first, lp1), (second, lp2) = top
            assert (first, second) == (token, other) and lp1 - lp2 < TIE, (what, p, part, a[part], b[part])


@pytest.mark.slow  # ~10 s
def test_gguf_greedy_tokens_at_tp2_are_tp1s(smollm2_q4):
    path, prompts = smollm2_q4
    [(tokens, logits, int4_bytes)] = run_ranks(1, greedy_and_logits, path, 1, prompts, 16, quantization="gguf")
    [(float_tokens, float_logits, float_bytes)] = run_ranks(1, greedy_and_logits, path, 1, prompts, 16)
    assert int4_bytes < 0.45 * float_bytes  # the linear layers in 4 bits; the embedding stays float32
    # the same weights as the dequantized float32 model: the prompts' rows (at least GEMM_ROWS, run
    # together) are multiplied in float, so the logits are the float model's up to summation order
    assert (logits - float_logits).abs().max() < 1e-3
    # a step's few rows round their activations to int8 (as llama.cpp does): the first answer keeps
    # the float model's tokens; the second's first token is a near tie in the float model (logprobs
    # -1.883 and -1.965), which the LM head's rounded input flips, as llama.cpp's own does
    assert tokens[0] == float_tokens[0]
    [want] = run_ranks(1, greedy_top2, path, 1, prompts, 16, quantization="gguf")
    assert [[t for t, _ in seq] for seq in want] == tokens  # logprobs asked for change nothing
    for rank, got in enumerate(run_ranks(2, greedy_top2, path, 2, prompts, 16, quantization="gguf")):
        assert_same_up_to_a_near_tie(got, want, f"rank {rank} of tp=2")


@pytest.mark.slow
def test_gguf_greedy_tokens_at_tp3_are_tp1s(smollm2_q4):
    """tp=3 splits SmolLM2's 9 heads 3+3+3 and its MLP 512 x 3 (~15 s: three ranks load the model)."""
    path, prompts = smollm2_q4
    [want] = run_ranks(1, greedy_top2, path, 1, prompts, 16, quantization="gguf")
    for rank, got in enumerate(run_ranks(3, greedy_top2, path, 3, prompts, 16, quantization="gguf")):
        assert_same_up_to_a_near_tie(got, want, f"rank {rank} of tp=3")


def int4_layers(model: str, tp: int):
    """On this rank: for each packed layer, (|layer(x) - x @ dequantized W^T| max, |ref| max), and
    the dequantized weight of the first MLP down projection's shard."""
    from shardlm.parallel.int4 import Int4Blocks, int4_groups
    from shardlm.parallel.tensor import ColumnParallelLinear, Int8Weight, RowParallelLinear, linear

    worker = make_worker(model, tp, quantization="int4")
    assert worker.runner.cpu_ops  # int4 weights: the cache write and decode attention in C++ too
    assert not make_worker(model, tp).runner.cpu_ops  # float weights: the Python ops
    src = worker.checkpoint.source()
    errors, down = [], None
    g = torch.Generator().manual_seed(0)
    for m in worker.model.modules():
        if not isinstance(m, Int8Weight):
            continue
        if isinstance(m, ColumnParallelLinear):
            w = torch.cat([src.read(f"{n}.weight", rows=r) for n, r in m.sources])
        else:
            w = src.read(f"{m.source}.weight", cols=m.cols)
        blocks: Int4Blocks = int4_groups(w)
        ref_w = blocks.dequantize()
        assert (ref_w - w).abs().max() <= blocks.scale.max() / 2 + 1e-3  # round to nearest (float16 offsets)
        x = torch.randn(5, w.shape[1], generator=g)
        want = x @ ref_w.T
        errors.append(((linear(x, m.weight, None, m.weight_scale) - want).abs().max().item(), want.abs().max().item()))
        if down is None and isinstance(m, RowParallelLinear) and m.source.endswith("down_proj"):
            down = ref_w
    return errors, down


@pytest.mark.parametrize("tp", [2, pytest.param(3, marks=pytest.mark.slow)])  # tp=3: ~10 s more
def test_int4_layers_match_their_dequantized_weights_at_one_rank_and_at_tp(qwen3, tp):
    whole_run = run_ranks(1, int4_layers, str(qwen3.path), 1)
    results = run_ranks(tp, int4_layers, str(qwen3.path), tp)
    for size, run in ((1, whole_run), (tp, results)):
        for rank, (errors, _) in enumerate(run):
            for err, scale in errors:
                # x rounded to int8 per group of 32 (1/254 of its largest |x|): 1e-2 of the largest output
                assert err <= 1e-2 * scale, f"rank {rank} of tp={size}: {err} of {scale}"
    # the row-parallel shards are tp=1's columns: no group straddles the split
    assert torch.equal(torch.cat([d for _, d in results], dim=1), whole_run[0][1]), f"tp={tp}"


def test_int4_error_against_hf_is_bounded(qwen3):
    [(_, _, full_bytes)] = run_ranks(1, greedy_and_logits, str(qwen3.path), 1, PROMPTS[-1:], NEW_TOKENS)
    [(_, logits, int4_bytes)] = run_ranks(
        1, greedy_and_logits, str(qwen3.path), 1, PROMPTS[-1:], NEW_TOKENS, quantization="int4"
    )
    err = (logits - qwen3.logits).abs()
    top1 = (logits.argmax(-1) == qwen3.logits.argmax(-1)).float().mean()
    # measured: mean 0.64, top-1 0.48, max 4.2 (a random model's logits are flat and its weights
    # Gaussian: 16 levels per group cost more than on a trained model; SmolLM2: docs/performance.md)
    assert 1e-3 < err.mean() < 1.0, f"mean |dlogit| {err.mean():.4f}"
    assert top1 >= 0.4
    assert int4_bytes < 0.6 * full_bytes  # the embedding (tied head) stays float32
    for tp in (2, 3):
        for rank, (_, tp_logits, _) in enumerate(
            run_ranks(tp, greedy_and_logits, str(qwen3.path), tp, PROMPTS[-1:], NEW_TOKENS, quantization="int4")
        ):
            assert (tp_logits - logits).abs().mean() < 0.06, f"rank {rank} of tp={tp}"


def test_int4_refuses_a_shard_whose_in_features_straddle_groups(tiny):
    """Tiny Llama: 6 heads of 16; at tp=2 a rank's o_proj takes 48 in-features, not whole groups."""
    path = str(tiny("llama").path)
    with pytest.raises(UsageError, match=r"in-features \[0, 200\) on this rank, which do not split into groups"):
        make_worker(path, 1, quantization="int4")  # the MLP's 200 columns: not even at tp=1
    with pytest.raises(UsageError, match="quantization='gguf' keeps a GGUF file's 4-bit blocks"):
        make_worker(path, 1, quantization="gguf")


@pytest.mark.slow
def test_compiled_decode_with_int4_weights_gives_eager_tokens(tmp_path_factory):
    """The int4 kernel is an opaque op (shardlm::int4_linear) in the compiled graph: compiled decode
    gives eager's tokens with one graph per shape class (~100 s: inductor compiles two classes)."""
    from harness.rankfns import compiled_runs, llm_greedy

    ref = build_tiny("qwen3", tmp_path_factory.mktemp("qwen3_int4_compile"), num_hidden_layers=2, **TINY)
    [(runs, classes, graphs)] = run_ranks(1, compiled_runs, str(ref.path), PROMPTS, NEW_TOKENS, quantization="int4")
    [(eager, _, _)] = run_ranks(1, llm_greedy, str(ref.path), PROMPTS, NEW_TOKENS, block_size=4, quantization="int4")
    assert classes == {False, True} and graphs == 2
    indices, _, tokens = runs[0]  # every prompt, decoded together
    assert tokens == [eager[i] for i in indices]
    assert eager != ref.tokens  # int4: not HF's float32 answers, so the option took effect


@pytest.mark.slow
def test_gguf_greedy_tokens_at_pp2_are_pp1s(smollm2_q4):
    """Each pipeline stage packs only its own layers' blocks; the tokens are one process's (~10 s)."""
    from harness.rankfns import llm_greedy

    path, prompts = smollm2_q4
    [(tokens, _, _)] = run_ranks(1, llm_greedy, path, prompts, 8, quantization="gguf")
    stages = run_ranks(2, llm_greedy, path, prompts, 8, quantization="gguf", pp=2)
    for rank, (pp_tokens, _, _) in enumerate(stages):
        assert pp_tokens == tokens, f"stage {rank} of pp=2"
    assert [list(layers) for _, _, layers in stages] != [list(range(30))] * 2  # the stages split the layers

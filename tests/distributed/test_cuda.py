"""The CUDA path: the engine on a GPU inside an NCCL process group (world size 1) gives HF
transformers' greedy tokens and logits, eager and compiled; and ``device`` picks and checks
the GPU. Skipped where no GPU is present (CI has none); on a GPU host: ``pytest tests/distributed/test_cuda.py``.

Tolerance: as on CPU (test_tp_models): float32 tokens identical to HF's (recorded on CPU) and
logits within rtol = atol = 1e-4. CUDA sums in another order than the CPU kernels (float32
matmuls, no TF32: torch's default), which moves logits by ~1e-5 at these sizes.
"""

from __future__ import annotations

import gc

import pytest
import torch

from harness.multirank import run_ranks, run_ranks_on
from harness.rankfns import compiled_runs, greedy_and_logits, worker_device
from harness.reference import NEW_TOKENS, PROMPTS, TINY_MODELS, build_tiny
from shardlm import LLM, SamplingParams
from shardlm.errors import UsageError
from shardlm.launch import resolve_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_cuda
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_models_on_cuda_match_hf(tiny, name):
    ref = tiny(name)
    [(tokens, logits, _)] = run_ranks_on(
        "nccl", 1, greedy_and_logits, str(ref.path), 1, PROMPTS, NEW_TOKENS, device="cuda", dtype="float32"
    )
    assert tokens == ref.tokens
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_smollm2_on_cuda_matches_hf(smollm2):
    path, prompts, ref, _ = smollm2
    [(tokens, logits, _)] = run_ranks_on(
        "nccl", 1, greedy_and_logits, path, 1, prompts, NEW_TOKENS, device="cuda", dtype="float32"
    )
    assert tokens == ref.tokens
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_compiled_decode_on_cuda_matches_hf(tmp_path):
    """compile=True on the GPU (inductor's Triton kernels): one graph per shape class, never
    recompiled over other batches, contexts and early finishes (as test_compile on CPU)."""
    ref = build_tiny("mistral", tmp_path, num_hidden_layers=2)
    [(runs, classes, graphs)] = run_ranks_on(
        "nccl", 1, compiled_runs, str(ref.path), PROMPTS, NEW_TOKENS, device="cuda", dtype="float32"
    )
    assert classes == {False, True} and graphs == 2
    for indices, max_tokens, tokens in runs:
        assert tokens == [ref.tokens[i][:n] for i, n in zip(indices, max_tokens)], f"prompts {indices}"


@needs_cuda
def test_llm_without_process_group_runs_on_cuda(tiny):
    """The public API in one process: device='auto' picks the GPU and gives HF's tokens."""
    ref = tiny("llama")
    with LLM(str(ref.path), dtype="float32") as llm:  # auto would pick bfloat16 on a GPU
        assert llm.worker.device.type == "cuda"
        out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS))
    assert [o.token_ids for o in out] == ref.tokens


@needs_cuda
def test_cpu_offload_keeps_layers_in_host_memory_and_gives_hfs_tokens(tiny):
    """--cpu-offload-gb (engine/offload.py): the first layers' weights in pinned host memory, copied in a
    layer ahead of use; HF's tokens, and the GPU holds the offloaded bytes less (to the allocator's
    512-byte rounding per tensor). int8 weights offload too, with the resident run's tokens."""
    ref = tiny("llama")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)

    def loaded(**options):  # an LLM, and the GPU memory its load took
        gc.collect()
        before = torch.cuda.memory_allocated()
        llm = LLM(str(ref.path), dtype="float32", kv_cache_memory=1 << 20, **options)
        return llm, torch.cuda.memory_allocated() - before

    llm, resident = loaded()
    with llm:
        layers = len(llm.worker.model.layers)
    del llm
    for gib, offloaded in [(1e-9, 1), (100, layers)]:  # one byte: the first layer; more than the model: all
        llm, took = loaded(cpu_offload_gb=gib)
        with llm:
            model, offload = llm.worker.model, llm.worker.offload
            assert len(offload.layers) == offloaded and offload.layers[0] is model.layers[0]
            hosted = [p for layer in offload.layers for p in layer.parameters()]
            assert all(p.device.type == "cpu" and p.is_pinned() for p in hosted)
            assert offload.bytes == sum(p.numel() * p.element_size() for p in hosted) > 0
            assert offload.largest_layer == max(sum(p.nbytes for p in layer.parameters()) for layer in offload.layers)
            assert abs(resident - took - offload.bytes) <= 512 * len(hosted), (resident - took, offload.bytes)
            assert llm.worker.runner.graphs is None  # eager: a graph cannot replay new copies
            out = llm.generate(PROMPTS, greedy)
            assert [o.token_ids for o in out] == ref.tokens
            assert all(p.device.type == "cpu" for p in hosted)  # back on the host after each layer
            assert list(offload.in_flight) == [0]  # the last layer started the first one's copy for the next step
        del llm, model, offload, hosted
    runs = []
    for gib in (0, 100):
        llm, _ = loaded(quantization="int8", cpu_offload_gb=gib)
        with llm:
            runs.append([o.token_ids for o in llm.generate(PROMPTS, greedy)])
        del llm
    assert runs[0] == runs[1]


@needs_cuda
def test_int4_weights_on_cuda_take_torchs_kernel(tmp_path):
    """quantization='int4' on a GPU (parallel/int4.py): the blocks repacked for torch's tinygemm
    kernel, 0.5 bytes a weight, give x @ the dequantized weight within bfloat16's rounding (a zero
    taken as the offset, without + 8 x scale, is caught); a tiny Qwen3 keeps the CPU int4 test's
    error bound against HF's float32 logits, and stays near the CPU int4 engine's logits."""
    from shardlm.parallel.int4 import int4_groups, int4_linear, pack_int4

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 256, generator=g), torch.randn(5, 256, generator=g)
    blocks = int4_groups(w)
    codes, scales = pack_int4(blocks, "cuda")
    assert codes.is_cuda and codes.numel() * codes.element_size() == 96 * 256 // 2
    want = x @ blocks.dequantize().T
    err = lambda s: (int4_linear(x.cuda().bfloat16(), codes, s).float().cpu() - want).abs().max() / want.abs().max()
    assert err(scales) < 2e-2
    wrong = scales.clone()
    wrong[..., 1] = blocks.offset.T.to(wrong)  # [groups, rows]: the offset as tinygemm's zero
    assert err(wrong) > 0.2
    ref = build_tiny("qwen3", tmp_path, intermediate_size=192)
    one = (str(ref.path), 1, PROMPTS[-1:], NEW_TOKENS)
    [(_, logits, _)] = run_ranks_on(
        "nccl", 1, greedy_and_logits, *one, device="cuda", dtype="bfloat16", quantization="int4"
    )
    [(_, cpu_logits, _)] = run_ranks(1, greedy_and_logits, *one, quantization="int4")
    dlogit = (logits - ref.logits).abs().mean().item()
    top1 = (logits.argmax(-1) == ref.logits.argmax(-1)).float().mean().item()
    near = (logits - cpu_logits).abs().mean().item()
    print(f"int4 on cuda: mean |dlogit| vs HF {dlogit:.3f}, top-1 {top1:.2f}, vs CPU int4 {near:.3f}")
    assert 1e-3 < dlogit < 1.0 and top1 >= 0.4  # test_int4's bounds for the CPU kernel
    assert near < 0.3  # bfloat16 activations here, int8-rounded ones there


def test_auto_device_gives_each_rank_a_gpu_or_uses_cpu():
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_device("auto", 1) == ("cuda" if gpus >= 1 else "cpu")
    assert resolve_device("auto", gpus + 1) == "cpu"  # more ranks than GPUs: CPU, not a crash in set_device
    assert resolve_device("cpu", 1) == "cpu"
    with pytest.raises(UsageError, match=f"needs as many GPUs, and it has {gpus}; use fewer ranks per host"):
        resolve_device("cuda", gpus + 1)


def test_cuda_refused_in_a_gloo_group(tiny):
    """A caller's gloo group cannot carry CUDA tensors: 'auto' stays on CPU, 'cuda' says why."""
    ref = tiny("llama")
    [device] = run_ranks(1, worker_device, str(ref.path), "auto")
    assert device == "cpu"
    if torch.cuda.is_available():
        with pytest.raises(AssertionError, match="none of them NCCL"):
            run_ranks(1, worker_device, str(ref.path), "cuda")

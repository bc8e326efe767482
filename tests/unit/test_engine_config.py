"""EngineConfig.for_model: what depends on the model and the device (dtype 'auto', vLLM's
--enable-expert-parallel), settled before any rank starts."""

from __future__ import annotations

import pytest

from shardlm.engine.config import EngineConfig
from shardlm.errors import UsageError
from shardlm.models.config import ModelConfig

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
)
MOE = dict(BASE, architectures=["MixtralForCausalLM"], num_local_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize(
    "stated, device, want",
    [
        ({}, "cpu", "float32"),  # nothing stated (GGUF): float32
        ({}, "cuda", "bfloat16"),  # a float32 checkpoint runs in bfloat16 on a GPU, as vLLM's auto
        ({"torch_dtype": "float32"}, "cpu", "float32"),
        ({"torch_dtype": "bfloat16"}, "cpu", "bfloat16"),
        ({"dtype": "float16"}, "cuda", "float16"),  # transformers >= 5 writes "dtype"
        ({"torch_dtype": "float8_e4m3fn"}, "cpu", "float32"),  # not one the engine computes in
    ],
)
def test_dtype_auto_is_the_checkpoints(stated, device, want):
    model = ModelConfig.from_hf({**BASE, **stated})
    assert EngineConfig().for_model(model, device).dtype == want
    assert EngineConfig(dtype="float32").for_model(model, device).dtype == "float32"  # given: kept


def test_torch_dtype_needs_auto_settled():
    with pytest.raises(ValueError, match="for_model"):
        _ = EngineConfig().torch_dtype


def test_enable_expert_parallel_spreads_experts_over_dp_x_tp():
    moe, dense = ModelConfig.from_hf(MOE), ModelConfig.from_hf(BASE)
    config = EngineConfig.of(tp=2, dp=2, enable_expert_parallel=True)
    settled = config.for_model(moe, "cpu").parallel
    assert (settled.ep, settled.etp, settled.tp, settled.dp) == (4, 1, 2, 2)
    assert config.for_model(moe, "cpu").for_model(moe, "cpu").parallel.ep == 4  # idempotent (ranks settle again)
    assert config.for_model(dense, "cpu").parallel.ep == 1  # a dense model: no effect, as in vLLM
    with pytest.raises(UsageError, match=r"ep=4, etp=1\), but ep=2"):
        EngineConfig.of(tp=2, dp=2, ep=2, enable_expert_parallel=True).for_model(moe, "cpu")


def test_gpu_memory_utilization_sizes_the_kv_cache_from_what_is_left():
    from shardlm.engine.config import kv_budget

    gib = 1 << 30
    assert kv_budget(0.9, free=70 * gib, total=80 * gib) == int(0.9 * 80 * gib) - 10 * gib  # 62 GiB for KV
    with pytest.raises(UsageError, match=r"allows 7.20 GiB of this GPU's 8.00 GiB, but 7.50 GiB are in use"):
        kv_budget(0.9, free=gib // 2, total=8 * gib)
    with pytest.raises(UsageError, match="sizes the KV cache from GPU memory, but this run is on cpu"):
        EngineConfig(gpu_memory_utilization=0.9).for_model(ModelConfig.from_hf(BASE), "cpu")
    with pytest.raises(UsageError, match=r"must be in \(0, 1\]"):
        EngineConfig(gpu_memory_utilization=1.5)


def test_int4_kv_cache_needs_head_dim_in_groups():
    """int4 groups a head's elements by 32 (or the whole head below 32): head_dim 48 is refused."""
    ok = ModelConfig.from_hf({**BASE, "hidden_size": 256, "num_attention_heads": 4})  # head_dim 64
    assert EngineConfig(kv_cache_dtype="int4").for_model(ok, "cpu").kv_cache_dtype == "int4"
    small = ModelConfig.from_hf(BASE)  # head_dim 4: one group
    EngineConfig(kv_cache_dtype="int4").for_model(small, "cpu")
    odd = ModelConfig.from_hf({**BASE, "hidden_size": 192, "num_attention_heads": 4})  # head_dim 48
    with pytest.raises(UsageError, match="head_dim=48 does not split into them; use kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int4").for_model(odd, "cpu")


def test_cpu_offload_gb_is_refused_where_it_cannot_work():
    """--cpu-offload-gb (engine/offload.py) moves GPU weights to the host: refused on CPU ranks,
    with compile, int4 weights (packed for their device at load), expert re-placement and a
    layer_skip draft (the offloaded first layers), each with its reason."""
    dense = ModelConfig.from_hf(BASE)
    assert EngineConfig(cpu_offload_gb=2).for_model(dense, "cuda").cpu_offload_gb == 2
    assert EngineConfig(cpu_offload_gb=2, quantization="int8").for_model(dense, "cuda").quantization == "int8"
    with pytest.raises(UsageError, match="this run is on cpu, whose weights are in CPU memory already"):
        EngineConfig(cpu_offload_gb=2).for_model(dense, "cpu")
    for bad in (-1, "4", True, float("nan")):
        with pytest.raises(UsageError, match="must be a number of GiB >= 0"):
            EngineConfig(cpu_offload_gb=bad)
    for option, why in [
        (dict(compile=True), "trace through hooks"),
        (dict(quantization="int4"), "packed for their device"),
        (dict(eplb_interval=10), "re-placing experts"),
        (dict(speculative_config={"method": "layer_skip", "num_layers": 1}), "every draft token would copy"),
    ]:
        with pytest.raises(UsageError, match=f"does not work with cpu_offload_gb=2: .*{why}"):
            EngineConfig(cpu_offload_gb=2, **option)

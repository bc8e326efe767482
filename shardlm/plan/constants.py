"""Efficiency factors and fixed overheads of the planner, each with its source.

Datasheet peaks are never reached; the planner multiplies them by these factors. They are
judgements anchored on published measurements, not fitted to any one run; the calibrated
``this-machine`` profile replaces them with measured rates (efficiency 1.0).
"""

from __future__ import annotations

MATMUL_EFFICIENCY = 0.70
"""Fraction of dense peak a large GEMM reaches. Megatron-LM reaches 52% of peak end to end,
bubbles and communication included (Narayanan et al. 2021, https://arxiv.org/abs/2104.04473
abstract and §5.1); the planner charges bubbles and communication separately, so the GEMM
share alone is set higher."""

HBM_EFFICIENCY = 0.80
"""Fraction of datasheet memory bandwidth a streaming kernel reaches: 750 of 900 GB/s (83%)
measured on V100 by Jia et al. 2018, "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking", https://arxiv.org/abs/1804.06826 §3."""

HOST_MEM_BPS_PER_GPU = 2 * 8 * 38.4e9 / 8 * HBM_EFFICIENCY
"""Host memory bandwidth a GPU's share of the host gets for ZeRO-Offload's CPU AdamW step: a DGX
H100's two Xeon Platinum 8480C sockets of eight DDR5-4800 channels (38.4 GB/s each) shared by its
eight GPUs, at the streaming efficiency of HBM_EFFICIENCY (no host is in the GPU catalog)."""

CPU_ADAM_BYTES_PER_PARAM = 28
"""Bytes a fused CPU AdamW step streams per float32 parameter: the gradient, master, and two
moments read (16) and the master and moments written (12)."""

LINK_EFFICIENCY = 0.80
"""Fraction of the per-direction link bandwidth a ring collective reaches ("bus bandwidth"
in nccl-tests, https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md)."""

NIC_EFFICIENCY = 0.85
"""Fraction of NIC line rate a large inter-node collective reaches (same source as above)."""

GEMM_HALF_ROWS = 128
"""Rows (tokens) at which a GPU GEMM reaches half of its large-size efficiency: small GEMMs fill
few tensor-core tiles and wait on memory (NVIDIA, "Matrix Multiplication Background User's
Guide", https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/
§2-4: throughput falls steeply once a dimension drops below a few hundred). A rule of thumb, kept
for GPUs with no measured fixed GEMM time (``GpuSpec.gemm_fixed_us``, which replaces it where the
catalog has one). CPUs have no such tiles; the calibrated profile uses 0."""

COLLECTIVE_LAUNCH_S = 5e-6
"""Fixed cost of launching one collective kernel on a GPU (order of magnitude of CUDA
kernel launch plus NCCL setup for a small message; nccl-tests small-size rows)."""

MOE_BLOCK_FLOOR_S = 9.04e-3
"""Megatron-Core's MoE block never ran one micro-batch's forward and backward faster than this on
H100s, whatever its work, so ``--kernels fused`` training plans on GPUs price none faster
(``training._moe_floor``; the block is the MoE layer but its attention's products and core).

Source: marin-community/marin#3666, with Megatron-LM's ``moe_perf`` method: one ``MoELayer`` in
BF16 on 8 H100s at ep8, 4,096 tokens a rank, forced-balanced routing, fused permutation and router,
TE grouped GEMMs, CUDA events around the passes after a dummy 8,192^3 GEMM. With DeepEP, eight
shapes of 128 experts took 9.04-12.41 ms although their work spans 16x: Qwen3-30B-A3B's (experts
of 768, top-8, h 2,048) 12.41 ms, Qwen3-235B's (4x its work) 11.75, top-2 (a quarter) 9.04, h 4,096
9.71. The time follows the block's launches and synchronisations, not its work. The floor is the
least of them; two sequences a micro-batch took 12.42 ms, four 18.09, and the sweep's all-to-all and
HybridEP runs 11.4-45. NVIDIA's Megatron-Core MoE report (arXiv 2603.07685, §4.3.6-4.3.7) names the
cause: in dropless MoE "the host must query per-expert token counts from the GPU to launch token
dispatching and Grouped GEMMs", a synchronisation "placing the CPU on the critical path", and the
CPU overhead left under partial CUDA graphs "is primarily confined to the region between token
dispatch and combine".

Not fitted: the validation rows (``test_plan_published``) ran other layouts, GPUs and FP8 (docs/plan.md,
"MoE costs", gives their errors with this floor, with the 30B shape's time in its place, and without
one). Under Megatron's 1F1B all-to-all overlap (``--ep-overlap``) the floor stays, less what the
other micro-batch hides of it: a merged forward and backward takes at least the forward's attention
(the host's wait for the token counts follows it) and one floor (``training._merged_pair``).
shardlm's own MoE block (``--kernels shardlm``, the default) launches other kernels and has not
been measured on a GPU (``benchmarks/moe_train_profile.py`` measures it): no floor is priced for it."""

DEEPEP_SMS = 20
"""Streaming multiprocessors DeepEP's dispatch and combine kernels occupy (its default, as
Megatron-Core runs it): beside another micro-batch's GEMMs under the 1F1B all-to-all overlap those
run on the rest (``training._merged_pair``). NVIDIA's Megatron-Core MoE report (arXiv 2603.07685,
§4.2.3): "DeepEP uses 20 SMs per GPU and introduces roughly 20% GEMM-efficiency overhead" in its
DeepSeek-V3 runs on H100 (132 SMs: the GEMMs keep 112, 15% fewer). HybridEP's count is a recipe
setting (16-32 in Megatron-Bridge's); NCCL's all-to-all kernels are not charged (their channel
count varies with the topology)."""

GPU_OP_OVERHEAD_S = 0.0
"""Per-operator dispatch cost on a GPU. Serving engines capture decode in CUDA graphs
(vLLM, https://docs.vllm.ai/en/latest/design/cuda_graphs.html), so it is taken as zero;
the calibrated CPU profile measures its own."""

INFERENCE_RESERVE_FRACTION = 0.10
"""Serving: the share of device memory an engine leaves out of its KV-cache budget, vLLM's default
``gpu_memory_utilization=0.9`` (https://docs.vllm.ai/en/latest/configuration/engine_args.html;
``shardlm serve --gpu-memory-utilization`` sizes the cache the same way)."""

TRAINING_RESERVE_GIB = 2.0
"""Training: device memory outside what the planner counts: the CUDA context (723-800 MiB when a
PyTorch process first touches a GPU, https://discuss.pytorch.org/t/what-is-the-reason-for-pytorchs-gpu-memory-floor/73021,
https://discuss.pytorch.org/t/high-gpu-memory-overhead/81330) plus cuBLAS / NCCL workspaces and
allocator slack of about as much again. A share of the device (the old 10%) would reserve 8 GiB
on an 80 GiB card and reject layouts that published runs fill to within a few GiB."""

DDP_BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default gradient bucket (``bucket_cap_mb=25``; Li et al. 2020,
https://arxiv.org/abs/2006.15704 §3.2.3); two are in flight."""

DP_OVERLAP_FRACTION = 0.8
"""Share of the backward pass that can hide data-parallel gradient communication (bucketed
all-reduce overlapped with backward, Li et al. 2020 §3.2.3; the last bucket cannot hide)."""

PREFILL_CHUNK_TOKENS = 8192
"""Tokens one step processes at most (chunked prefill): shardlm's ``max_num_batched_tokens``
default (``engine/config.py``; decodes take one each, prompts the rest), and vLLM's with chunked
prefill on."""

NEAR_TIE_FRACTION = 0.03
"""Layouts whose score is within 3% of the best are treated as ties; among ties the planner
picks the one that follows the known placement rules (model error is larger than 3%)."""

FLASH_BACKWARD_RATIO = 2.5
"""A flash attention backward's FLOPs over its forward's: five products (the scores recomputed, then
the gradients of V, of the probabilities, of Q and of K) against the forward's two, as
flash-attention's benchmarks count them (``flops(..., mode="bwd")`` = 2.5 x forward, Dao-AILab/
flash-attention benchmarks/; FlashAttention-2, https://arxiv.org/abs/2307.08691 §3.1.2)."""

FP32_BYTES = 4
BF16_BYTES = 2
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}
"""Bytes per element of each dtype the planner accepts."""

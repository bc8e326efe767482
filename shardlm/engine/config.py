"""EngineConfig: everything a rank needs to build its part of the engine (picklable)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from shardlm.engine.speculative import SpeculativeConfig
from shardlm.errors import UsageError
from shardlm.models.attention import INT4_GROUP, INT4_GROUPED, INT8_SCALED
from shardlm.models.config import ModelConfig
from shardlm.parallel.context import check_ulysses
from shardlm.parallel.dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_CACHE_DTYPES = {
    "int8": INT8_SCALED,
    "int4": INT4_GROUPED,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""KV-cache element types besides "auto" (the model's dtype); the fp8 names are vLLM's --kv-cache-dtype."""
QUANTIZATIONS = (None, "int8", "int4", "gguf")
"""Weight formats ``quantization`` takes (see its docstring)."""
AXES = ("dp", "pp", "cp", "tp", "ep", "etp")
"""The parallel axes the engine runs."""
CP_ATTENTION = ("pass-q", "ulysses", "ring")
"""How a whole prompt is attended under cp (``EngineConfig.cp_attention``)."""


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str = "smollm2"
    """'smollm2' (the embedded SmolLM2-135M-Instruct GGUF), a HF directory, or a .gguf file."""
    parallel: ParallelDims = field(default_factory=ParallelDims)
    """The layout over ranks (dp x pp x cp x tp, experts folded as ep x etp; ``AXES``); tp may be any
    value from 1 to the number of attention heads; cp stripes every sequence and its KV cache over
    its ranks (``parallel/context_paged.py``)."""
    pp_layers: tuple[int, ...] | None = None
    """Layers per pipeline stage, e.g. (10, 10, 10); default: balanced by per-token work (the LM head
    counts, the embedding lookup does not)."""
    micro_batches: int | None = None
    """Batches in flight through the pipeline; default pp (enough to keep every stage busy)."""
    eplb_interval: int = 0
    """Serving, MoE: re-place experts from the observed load every this many rounds (0: never)."""
    eplb_redundant: int = 0
    """Serving, MoE: extra expert slots per layer for replicas of the hottest experts (EPLB)."""
    dtype: str = "auto"
    """Weights, activations and KV cache: float32, bfloat16, float16, or 'auto' (vLLM's default):
    the checkpoint's dtype (``ModelConfig.checkpoint_dtype``; float32 for GGUF), except that a
    float32 checkpoint runs in bfloat16 on a GPU."""
    enable_expert_parallel: bool = False
    """vLLM's flag: MoE layers split their experts over all dp x tp ranks of a stage (ep = dp x tp,
    etp = 1) instead of the ep / etp given; no effect on a dense model."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; default: the model's max_position_embeddings."""
    kv_cache_memory: int = 2 << 30
    """Bytes of KV cache per rank (an upper bound; pages are touched only as used)."""
    gpu_memory_utilization: float | None = None
    """vLLM's flag, on a GPU: the KV cache takes what is left of this fraction of the GPU's memory
    once the weights are loaded (``kv_budget``; instead of kv_cache_memory); the rest stays free
    for activations and workspace. Refused on CPU."""
    cpu_offload_gb: float = 0
    """vLLM's flag, on a GPU: this many GiB of each rank's decoder-layer weights stay in pinned CPU
    memory and are copied in a layer ahead of use on a side stream (``engine/offload.py``), for a
    model larger than the GPU; such a run is eager (no CUDA graphs; ``compile`` refused). Refused on CPU."""
    quantization: str | None = None
    """Weight-only quantization of the column- and row-parallel linear layers; MoE experts keep
    ``dtype``, and the embedding and LM head too but with int4 / gguf (then Q8_0 blocks). None: the checkpoint's weights in ``dtype`` (a GGUF file's
    blocks dequantized, as HF transformers loads it). 'int8': each output row with its own scale
    (absmax / 127 of the whole row, so every layout holds the same int8 weights), computed by each
    rank on its shard after loading. 'int4': group-wise asymmetric int4 (a scale and offset per 32
    input columns, multiplied in integers on the CPU as llama.cpp does; the embedding and LM head as
    Q8_0 blocks): a GGUF file's Q4_0/Q4_1/Q4_K (and Q8_0 embedding) blocks are taken as they are,
    other weights quantized from float. 'gguf' (vLLM's name; GGUF files only): the file's
    Q4_0/Q4_1/Q4_K layers kept as int4 and a Q8_0 embedding / LM head as Q8_0, every other type
    dequantized to ``dtype`` (no kernel takes the other k-quants' blocks, nor Q8_0's per-block scales
    in a linear layer). int4 and gguf run on CPU (shardlm's kernel) and on CUDA (torch's tinygemm
    kernel, bfloat16 activations): ``parallel/int4.py``."""
    kv_cache_dtype: str = "auto"
    """The KV cache's element type: 'auto' (the model's dtype); 'int8' (one byte an element plus a
    float32 scale per token and head: absmax / 127); or 'fp8' = 'fp8_e4m3', 'fp8_e5m2' (one byte,
    no scale, as vLLM's fp8 cache without calibrated scales). A one-byte cache holds 2-4x the tokens
    in the same memory; attention widens what it reads back to the model's dtype (errors: docs/performance.md)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    max_num_seqs: int = 256
    """Most sequences decoded together."""
    max_num_batched_tokens: int = 8192
    """Most prompt tokens prefilled in one step; longer prompts are prefilled in chunks."""
    seed: int = 0
    """Base seed; a request without its own seed uses seed + its index."""
    device: str = "auto"
    """'cpu', 'cuda' or 'auto': cuda when this host has a GPU for each of its ranks (and a process
    group the caller started can carry CUDA tensors, i.e. has NCCL), else cpu."""
    compile: bool = False
    """Run decode steps through torch.compile (inductor), which fuses the small ops between the
    matrix products; steps with short prompts too, their prompt tokens as decode rows. Each shape
    class (one sequence, several) compiles on its first step: tens of seconds on a small CPU,
    then cached on disk. Dense models only."""
    enforce_eager: bool = False
    """Never use CUDA graphs (vLLM's flag). Otherwise, on a GPU without ``cpu_offload_gb``, steps of dense models at tp=1 of up
    to max_num_seqs tokens (decodes, and prompt tokens as decode rows) replay a CUDA graph per shape
    class (tokens padded to 1, 2, 4, 8, 16, 24, ...; tables to a power of two of blocks), captured
    on the class's first step. CPU runs are eager."""
    speculative_config: SpeculativeConfig | dict | None = None
    """Speculative decoding, vLLM's form: {"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 1}: drafts looked up in each sequence's own
    history, verified in the step that feeds them (greedy output unchanged)."""
    cp_attention: str = "pass-q"
    """With cp > 1: how a prompt that arrives whole (nothing cached before it) is attended.
    'pass-q' (default): as every step, the queries all-gathered and attended to the striped cache
    where it lies; 'ulysses': all-to-alls give each rank the whole prompt for 1/cp of the heads
    (one fused causal kernel), then its own tokens back; cp must split the KV heads (or their query
    groups); 'ring': each rank keeps its tokens' queries and the prompt's keys and values pass
    around the cp ranks (cp - 1 hops, each overlapped with the attention of the block before).
    Steps with a cached context use pass-Q either way (``parallel/context_paged.py``)."""
    prefill_replicas: int = 0
    """Serving: prefill/decode disaggregation. The first this many of the dp replicas only compute
    prompts (and each first token); the rest only decode, receiving each prompt's KV cache from
    the replica that computed it. 0: every replica does both."""
    threads: int | None = None
    """CPU threads per rank; default: the cores shared evenly among the local ranks."""
    timeout_s: float = 300.0
    """A collective that waits longer than this ends the run with an error."""

    @classmethod
    def of(cls, **options) -> EngineConfig:
        """From the flat keywords ``LLM`` and the CLI take: the axis sizes (tp=2, ...) become ``parallel``."""
        return cls(parallel=ParallelDims.take(options), **options)

    def __post_init__(self) -> None:
        if not isinstance(self.parallel, ParallelDims):
            raise UsageError(f"parallel={self.parallel!r} must be a ParallelDims, e.g. ParallelDims(tp=2)")
        self.parallel.refuse_beyond(AXES, "the inference engine")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise UsageError(f"dtype={self.dtype!r} is not supported; use auto or one of {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise UsageError(
                f"quantization={self.quantization!r} is not supported; use one of "
                f"{', '.join(repr(q) for q in QUANTIZATIONS)}"
            )
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise UsageError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported; use auto or one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise UsageError(f"device={self.device!r} is not supported; use auto, cpu or cuda")
        util = self.gpu_memory_utilization
        if util is not None and (isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1):
            raise UsageError(f"gpu_memory_utilization={util!r} must be in (0, 1], e.g. 0.9")
        for name in ("eplb_interval", "eplb_redundant"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise UsageError(f"{name}={getattr(self, name)!r} must be a non-negative integer (0 turns it off)")
        if self.micro_batches is not None and (not isinstance(self.micro_batches, int) or self.micro_batches < 1):
            raise UsageError(
                f"micro_batches={self.micro_batches!r} must be a positive integer, e.g. {self.parallel.pp}"
            )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"{name}={v!r} must be a positive integer")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"max_model_len={self.max_model_len!r} must be at least 2 tokens")
        split, dp = self.prefill_replicas, self.parallel.dp
        if isinstance(split, bool) or not isinstance(split, int) or not 0 <= split < dp:
            fits = f"0 to {dp - 1}" if dp > 1 else "0 (no split)"
            more = f", or raise dp to {split + 1}" if isinstance(split, int) and split > 0 else ""
            raise UsageError(
                f"prefill_replicas={split!r} must leave at least one of the dp={dp} "
                f"replicas to decode; use {fits}{more}"
            )
        object.__setattr__(self, "speculative_config", SpeculativeConfig.of(self.speculative_config))  # frozen
        self._check_cp()
        self._check_offload()
        if not self.timeout_s > 0:
            raise UsageError(f"timeout_s={self.timeout_s!r} must be positive, e.g. 300")

    def _check_cp(self) -> None:
        """Refuse what context parallelism does not run yet, each with its reason."""
        cp = self.parallel.cp
        if self.cp_attention not in CP_ATTENTION:
            raise UsageError(f"cp_attention={self.cp_attention!r} is not one of {', '.join(CP_ATTENTION)}")
        if cp == 1:
            if self.cp_attention != "pass-q":
                raise UsageError(
                    f"cp_attention={self.cp_attention!r} splits attention over cp ranks, and cp=1; "
                    "raise cp (--cp 2) or drop cp_attention"
                )
            return
        refused = {
            "speculative_config": "a verify step's draft rows would need their own owners on the cp ranks",
            "compile": "the striped step's gather and all-to-all are not traced yet",
            "prefill_replicas": "a handoff would move a cache striped over cp ranks",
        }
        self._refuse_beside(f"cp={cp} yet", refused)

    def _refuse_beside(self, what: str, refused: dict[str, str]) -> None:
        """Refuse the first option of ``refused`` that is set, with its reason: it does not work with ``what``."""
        for name, why in refused.items():
            if getattr(self, name):
                raise UsageError(f"{name}={getattr(self, name)!r} does not work with {what}: {why}; drop one")

    def dims(self) -> ParallelDims:
        """The layout, without a mesh: each rank builds its own on a copy."""
        return self.parallel.unbuilt()

    def for_model(self, model: ModelConfig, device_type: str) -> EngineConfig:
        """This config with what depends on the model and the device settled: dtype 'auto', and
        ``enable_expert_parallel``'s ep (idempotent)."""
        if self.gpu_memory_utilization is not None and device_type != "cuda":
            raise UsageError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} sizes the KV cache from GPU memory, but "
                f"this run is on {device_type}; give kv_cache_memory (--kv-cache-memory) instead"
            )
        if self.cpu_offload_gb and device_type != "cuda":
            raise UsageError(
                f"cpu_offload_gb={self.cpu_offload_gb} keeps GPU weights in CPU memory, and this run is on "
                f"{device_type}, whose weights are in CPU memory already; drop it"
            )
        if model.is_mla and self.parallel.cp > 1:
            raise UsageError(
                f"cp={self.parallel.cp} stripes K/V heads over ranks, and DeepSeek's latent attention cache is not "
                "striped yet; use cp=1 (tp, pp, dp and ep split a DeepSeek model)"
            )
        if self.cp_attention == "ulysses":  # every tp rank's heads must split over cp
            check_ulysses(model.num_heads, model.num_kv_heads, self.parallel.tp, self.parallel.cp)
        d = model.kv_lora_rank + model.qk_rope_head_dim if model.is_mla else model.head_dim
        if self.kv_cache_dtype == "int4" and (d % 2 or d % min(INT4_GROUP, d)):
            what = "latent + rope row" if model.is_mla else "head_dim"
            raise UsageError(
                f"kv_cache_dtype='int4' quantizes each cache row's elements in groups of {INT4_GROUP}, and this "
                f"model's {what}={d} does not split into them; use kv_cache_dtype='int8' or 'fp8'"
            )
        dtype = self.dtype
        if dtype == "auto":
            dtype = model.checkpoint_dtype
            if device_type == "cuda" and dtype == "float32":
                dtype = "bfloat16"
        parallel = self.parallel
        if self.enable_expert_parallel and model.is_moe:
            n = parallel.dp * parallel.tp
            if parallel.ep not in (1, n) or parallel.etp != 1:
                raise UsageError(
                    f"enable_expert_parallel puts the experts on all dp x tp = {n} ranks (ep={n}, etp=1), but "
                    f"ep={parallel.ep}, etp={parallel.etp} were given; drop one or the other"
                )
            parallel = ParallelDims.take({**parallel.sizes(), "ep": n, "etp": 1})
        return dataclasses.replace(self, dtype=dtype, parallel=parallel)

    def _check_offload(self) -> None:
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 <= gb < float("inf"):
            raise UsageError(f"cpu_offload_gb={gb!r} must be a number of GiB >= 0, e.g. 4 (0 offloads nothing)")
        if not gb:
            return
        refused = {
            "compile": "each step copies the offloaded weights into new GPU memory, which a compiled graph would trace through hooks",
            "eplb_interval": "re-placing experts rewrites weights that may be on the host",
        }
        if self.quantization != "int8":
            refused["quantization"] = "int4 and gguf weights are packed for their device as they load; int8 works"
        self._refuse_beside(f"cpu_offload_gb={gb}", refused)
        spec = self.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method == "layer_skip":
            raise UsageError(
                f"speculative method 'layer_skip' does not work with cpu_offload_gb={gb}: it drafts with the "
                "model's first layers, which stay on the host, so every draft token would copy them in again; "
                "use an ngram or draft_model speculative_config, or drop one"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            raise ValueError("dtype 'auto' is settled by EngineConfig.for_model(model, device) first")
        return DTYPES[self.dtype]

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype, self.torch_dtype)


def kv_budget(utilization: float, free: int, total: int) -> int:
    """KV-cache bytes for ``gpu_memory_utilization``: the fraction of the GPU's ``total`` bytes
    less what is already in use (``total - free``: this rank's weights, the CUDA context, any other
    process), as SGLang's static memory fraction; raises when nothing is left."""
    used = total - free
    budget = int(utilization * total) - used
    if budget <= 0:
        raise UsageError(
            f"gpu_memory_utilization={utilization} allows {utilization * total / 2**30:.2f} GiB of this GPU's "
            f"{total / 2**30:.2f} GiB, but {used / 2**30:.2f} GiB are in use already (weights, CUDA context, other "
            f"processes); raise it, or spread the model over more GPUs"
        )
    return budget

"""GPU catalog and the cluster a plan runs on.

``load_gpu("h100-sxm")`` reads ``data/gpus.json`` (datasheet numbers, sources cited there);
``Cluster`` says how many GPUs there are and how many share a node, and answers which
link a group of ranks talks over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from shardlm.plan import constants as C
from shardlm.plan.errors import PlanError, unknown

DATA = Path(__file__).parent / "data"
GIB = 2**30
"""Capacities are in GiB everywhere in the planner (device memory, the breakdown, the reserve)."""


def gib(nbytes: float) -> str:
    """``nbytes`` as the planner prints a capacity: "72.3 GiB"."""
    return f"{nbytes / GIB:,.1f} GiB"


THIS_MACHINE = "this-machine"


@dataclass(frozen=True, kw_only=True)
class Link:
    """One alpha-beta link: a message of n bytes costs ``alpha_s + n / bandwidth_Bps``."""

    alpha_s: float
    """Latency of one hop, seconds."""
    bandwidth_Bps: float
    """Achievable bytes per second in one direction."""


def _catalog_dtype(dtype: str) -> str:
    """The catalog's name for ``dtype`` (torch's ``bfloat16`` is ``bf16``)."""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


@dataclass(frozen=True, kw_only=True)
class GpuSpec:
    name: str
    """Catalog key, e.g. ``h100-sxm``."""
    display: str
    """Human name, e.g. ``NVIDIA H100 SXM5 80GB``."""
    memory_bytes: float
    """Device memory in bytes. Datasheet "80 GB" of HBM is 80 GiB (HBM stacks hold 2^n bytes:
    five 16 GiB HBM2e stacks on the A100 80GB, whose nvidia-smi total is 81,920 MiB), so the
    catalog's ``memory_gib`` are binary."""
    flops: dict[str, float]
    """Achievable dense FLOP/s per dtype (datasheet peak x MATMUL_EFFICIENCY, or measured)."""
    mem_Bps: float
    """Achievable memory bandwidth, bytes/s (datasheet x HBM_EFFICIENCY, or measured)."""
    intra: Link
    """GPU-to-GPU link inside a node (NVLink, xGMI, PCIe, or gloo on this machine)."""
    inter: Link
    """Per-GPU scale-out link between nodes (the NIC)."""
    host_Bps: float = 0.0
    """Host-device bandwidth one way (PCIe: half the datasheet's bidirectional total; 0: none, the
    device is the host's CPU)."""
    gpus_per_node: int = 8
    """GPUs of the reference system that share the fast intra-node link."""
    op_overhead_s: float = C.GPU_OP_OVERHEAD_S
    """Fixed dispatch cost per operator (zero on GPUs with CUDA graphs; measured on CPU)."""
    gemm_half_rows: float = C.GEMM_HALF_ROWS
    """GEMM rows at which the matmul rate is half its large-GEMM value (0: no size effect), for the
    dtypes with no measured fixed GEMM time (``half_rows``)."""
    gemm_half_k: dict[str, float] = field(default_factory=dict)
    """Per dtype, the inner dimension K at which a GEMM runs at half its large-K rate: each output
    tile pays a fixed prologue and epilogue beside its K-steps of math (``roofline.k_efficiency``);
    from the catalog's measured tables, absent (no K effect) where none was collected."""
    gemm_fixed_us: dict[str, float] = field(default_factory=dict)
    """Per dtype, the time in microseconds a GEMM takes beyond its FLOPs at the large-GEMM rate: launch,
    the first tiles' fill and the last wave's drain, the same for a GEMM of any size
    (``roofline.Work.gemms``); measured from the catalog's tables, 0 where none was collected. Where it
    is measured the tables need no rows term (``half_rows``)."""
    collective_launch_s: float = C.COLLECTIVE_LAUNCH_S
    """Fixed cost of one collective call, on top of the alpha-beta terms."""
    attention: dict[str, tuple[float, float]] = field(default_factory=dict)
    """The fused attention kernel's measured 16-bit rate by pass, "forward" and "backward": (FLOP/s
    at long contexts, keys per query at which it runs at half that), its FLOPs counted as
    flash-attention's benchmarks count them (a backward is ``C.FLASH_BACKWARD_RATIO`` forwards);
    from the catalog's published tables, empty where none was collected (``attention_rate``)."""
    compute_capability: float = 0.0
    """CUDA compute capability (9.0 Hopper, 10.0 B200 and GB200, 10.3 GB300), from the catalog; 0 where
    none (an AMD part, this machine)."""
    sms: int = 0
    """Streaming multiprocessors (compute units), from the catalog: the share a communication kernel
    occupies beside the GEMMs (``C.DEEPEP_SMS``); 0 where unknown (none charged)."""
    source: str = ""
    """Where the numbers come from."""
    calibrated: dict = field(default_factory=dict, compare=False, repr=False)
    """Raw measurements when the spec comes from calibration (this-machine)."""

    def half_k(self, dtype: str) -> float:
        """``gemm_half_k`` for ``dtype`` (0: none measured)."""
        return self.gemm_half_k.get(_catalog_dtype(dtype), 0.0)

    def half_rows(self, dtype: str) -> float:
        """The rows rule for ``dtype``: ``gemm_half_rows``, or 0 where its fixed GEMM time is measured
        (which the measured tables show replaces it)."""
        return 0.0 if self.gemm_fixed_s(dtype) else self.gemm_half_rows

    def gemm_fixed_s(self, dtype: str) -> float:
        """``gemm_fixed_us`` for ``dtype``, in seconds (0: none measured)."""
        return self.gemm_fixed_us.get(_catalog_dtype(dtype), 0.0) * 1e-6

    def attention_rate(self, keys: float, backward: bool, dtype: str) -> float | None:
        """FLOP/s of the attention core's forward, or its ``backward``, where each query attends
        ``keys`` keys, on the measured curve (``attention``); None where the catalog has none for
        this ``dtype`` (16-bit only)."""
        curve = self.attention.get("backward" if backward else "forward")
        if curve is None or _catalog_dtype(dtype) not in ("bf16", "fp16"):
            return None
        rate, half = curve
        return rate * keys / (keys + half)

    @property
    def fp8_gemm_any_layout(self) -> bool:
        """Whether FP8 GEMMs take their operands in any layout, so that a per-tensor-scaled cast writes
        no transpose for the weight gradient (Transformer Engine's ``nvte_is_non_tn_fp8_gemm_supported``:
        compute capability 10.0 to 11.x, or 13.0 and up; Hopper's FP8 GEMMs take only the TN layout)."""
        return 10.0 <= self.compute_capability < 12.0 or self.compute_capability >= 13.0

    def matmul_flops(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        base = _catalog_dtype(dtype)
        if base in self.flops:
            return self.flops[base]
        raise PlanError(
            f"{self.name} has no {dtype} matmul rate in the catalog (it lists {', '.join(self.flops)}); "
            f"pick --dtype from those"
        )


@lru_cache(maxsize=1)
def _raw_catalog() -> dict:
    return json.loads((DATA / "gpus.json").read_text())


def gpu_names(with_aliases: bool = False) -> list[str]:
    raw = _raw_catalog()
    names = [k for k in raw if not k.startswith("_")]
    if with_aliases:
        names += [a for k in names for a in raw[k].get("_aliases", [])]
    return names


def load_gpu(name: str) -> GpuSpec:
    """The catalog GPU called ``name`` (or one of its aliases), with efficiency applied.
    ``this-machine`` is not in the catalog: ``plan.calibrate.machine_spec`` measures it."""
    raw = _raw_catalog()
    key = name.lower()
    if key not in raw or key.startswith("_"):
        alias_of = next((k for k in gpu_names() if key in raw[k].get("_aliases", [])), None)
        if alias_of is None:
            raise unknown("gpu", name, gpu_names() + [THIS_MACHINE])
        key = alias_of
    g = raw[key]
    return GpuSpec(
        name=key,
        display=g["display"],
        memory_bytes=g["memory_gib"] * GIB,
        flops={k: v * 1e12 * C.MATMUL_EFFICIENCY for k, v in g["tflops"].items()},
        mem_Bps=g["hbm_gbs"] * 1e9 * C.HBM_EFFICIENCY,
        # datasheets quote bidirectional totals; one direction carries half
        intra=Link(alpha_s=g["link_latency_us"] * 1e-6, bandwidth_Bps=g["link_gbs"] / 2 * 1e9 * C.LINK_EFFICIENCY),
        inter=Link(alpha_s=g["nic_latency_us"] * 1e-6, bandwidth_Bps=g["nic_gbps"] / 8 * 1e9 * C.NIC_EFFICIENCY),
        gpus_per_node=g["gpus_per_node"],
        host_Bps=g.get("pcie_gbs", 0) / 2 * 1e9,
        source=g["_source"],
        gemm_half_k=dict(g.get("gemm_half_k", {})),
        gemm_fixed_us=dict(g.get("gemm_fixed_us", {})),
        sms=g.get("sms", 0),
        compute_capability=g.get("compute_capability", 0.0),
        attention={k: (tf * 1e12, half) for k, (tf, half) in g.get("attention", {}).items()},
    )


def datasheet_flops(device_name: str, dtype: str) -> float | None:
    """The datasheet dense matmul FLOP/s (no efficiency applied: what MFU divides by) of the catalog
    GPU that torch's ``device_name`` names (e.g. "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA
    H100 PCIe" the PCIe one); None when the catalog has no such GPU or dtype."""
    raw = _raw_catalog()
    name = device_name.lower()
    found = [k for k in gpu_names() if raw[k]["display"].split()[1].lower() in name]  # the model: H100, A100, ...
    if len(found) > 1:  # the form factor decides (SXM unless the name says PCIe), then the memory
        found = [k for k in found if ("pcie" in k) == ("pcie" in name)] or found
        found = [k for k in found if f"{raw[k]['memory_gib']}gb" in name.replace(" ", "")] or found
    if not found:
        return None
    base = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)
    tflops = raw[found[0]]["tflops"].get(base)
    return None if tflops is None else tflops * 1e12


@dataclass(frozen=True, kw_only=True)
class Cluster:
    gpu: GpuSpec
    """The (identical) device every rank runs on."""
    num_gpus: int
    """Ranks in the world."""
    gpus_per_node: int
    """Ranks that share one node's fast link; groups wider than this cross the NIC."""
    memory_reserve_bytes: float | None = None
    """Device memory kept out of the plan (``--memory-reserve``); None: ``reserve``'s default."""

    def reserve(self, train: bool) -> float:
        """Bytes per device the plan leaves free: ``memory_reserve_bytes`` when given, else
        TRAINING_RESERVE_GIB for training and INFERENCE_RESERVE_FRACTION of the device for serving."""
        if self.memory_reserve_bytes is not None:
            return self.memory_reserve_bytes
        return C.TRAINING_RESERVE_GIB * GIB if train else C.INFERENCE_RESERVE_FRACTION * self.gpu.memory_bytes

    def __post_init__(self) -> None:
        if self.memory_reserve_bytes is not None and not 0 <= self.memory_reserve_bytes < self.gpu.memory_bytes:
            raise PlanError(
                f"--memory-reserve {self.memory_reserve_bytes / GIB:g} GiB must be at least 0 and below the "
                f"{self.gpu.memory_bytes / GIB:g} GiB of a {self.gpu.name}; e.g. 2"
            )
        if self.num_gpus < 1:
            raise PlanError(f"--gpus {self.num_gpus}: need at least one GPU")
        if self.gpus_per_node < 1:
            raise PlanError(f"--gpus-per-node {self.gpus_per_node}: need at least one GPU per node")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            below = self.num_gpus // self.gpus_per_node * self.gpus_per_node
            fill = next(n for n in range(self.gpus_per_node, 0, -1) if self.num_gpus % n == 0)
            raise PlanError(
                f"--gpus {self.num_gpus} is not a whole number of nodes of {self.gpus_per_node}; "
                f"use a multiple of {self.gpus_per_node} (e.g. {below} or {below + self.gpus_per_node}), or, when "
                f"each node (NVLink domain) holds fewer of the job's GPUs, say how many with --gpus-per-node "
                f"(e.g. {fill})"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_gpus // self.gpus_per_node))

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

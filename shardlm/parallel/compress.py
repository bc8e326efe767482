"""Lower-precision payloads: encode float tensors as bf16 or int8 bytes, and decode them back.

``collectives.all_reduce(..., payload="bf16")`` and ``all_gather(..., payload=)`` use these:
every rank encodes its x, the encodings are all-gathered (on the shared-memory path or
gloo), and every rank decodes them (and sums in float32 in rank order), so all ranks
get bitwise the same result on any backend. The only error is each rank's encoding:

* ``"bf16"``: round to bfloat16 (8 significant bits): relative error <= 2^-8 per
  element per rank; half the bytes of float32.
* ``"int8"``: symmetric per-block quantisation (one float32 scale per 64 elements,
  scale = absmax / 127, as in LLM.int8's vector-wise scheme, Dettmers et al. 2022,
  https://arxiv.org/abs/2208.07339): absolute error <= absmax(block) / 254 per element
  per rank; ~0.27 of the bytes of float32.

Errors on SmolLM2's real tensor-parallel partial sums: docs/performance.md, "Lower-precision payloads".
"""

from __future__ import annotations

import torch
from torch import Tensor

PAYLOADS = ("bf16", "int8")
BLOCK = 64  # int8: elements per scale


def check_payload(payload: str, x: Tensor) -> None:
    if payload not in PAYLOADS:
        raise ValueError(f"payload={payload!r} is not a payload encoding; use one of {PAYLOADS} or None")
    if not x.dtype.is_floating_point:
        raise ValueError(
            f"payload={payload!r} compresses floating-point tensors; this one is {x.dtype} (pass payload=None)"
        )


def encoded_bytes(numel: int, payload: str) -> int:
    if payload == "bf16":
        return 2 * numel
    blocks = -(-numel // BLOCK)
    return 4 * blocks + BLOCK * blocks


def encode(x: Tensor, payload: str) -> Tensor:
    """x (any float dtype, any shape) as flat uint8 [encoded_bytes(x.numel())]."""
    flat = x.reshape(-1)
    if payload == "bf16":
        return flat.to(torch.bfloat16).view(torch.uint8)
    blocks = -(-flat.numel() // BLOCK)
    padded = flat.new_zeros(blocks * BLOCK, dtype=torch.float32)
    padded[: flat.numel()] = flat
    padded = padded.view(blocks, BLOCK)  # [blocks, 64]
    scale = padded.abs().amax(dim=1) / 127.0  # [blocks]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(padded / scale[:, None]).clamp_(-127, 127).to(torch.int8)  # [blocks, 64]
    return torch.cat([scale.view(torch.uint8), q.view(-1).view(torch.uint8)])


def decode(buf: Tensor, payload: str, numel: int) -> Tensor:
    """The float32 values [numel] an encoding stands for."""
    if payload == "bf16":
        return buf.view(torch.bfloat16).float()
    blocks = -(-numel // BLOCK)
    scale = buf[: 4 * blocks].view(torch.float32)  # [blocks]
    q = buf[4 * blocks :].view(torch.int8).view(blocks, BLOCK)  # [blocks, 64]
    return (q.float() * scale[:, None]).view(-1)[:numel]

"""Lower-precision payloads (bf16, int8 + scales) on every path: the error stays within the
bound each encoding promises, is not zero (the payload really was compressed), and every
rank gets bitwise the same result."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.multirank import run_ranks
from shardlm.parallel import comm, compress, shm


def data(seed: int, count: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, generator=g) * (1 + seed)


def bound(xs: list[torch.Tensor], payload: str) -> torch.Tensor:
    """Per-element error bound of the sum of encoded xs (plus float32 accumulation slack)."""
    if payload == "bf16":
        b = sum(x.abs() for x in xs) * 2.0**-8  # bf16 keeps 8 significant bits: unit roundoff 2^-8
    else:
        b = 0
        for x in xs:
            pad = torch.zeros(-(-x.numel() // compress.BLOCK) * compress.BLOCK)
            pad[: x.numel()] = x.abs()
            b = b + pad.view(-1, compress.BLOCK).amax(1).repeat_interleave(compress.BLOCK)[: x.numel()] / 254
    return b + 1e-6 * sum(x.abs() for x in xs)


def payload_checks(path: str) -> list[torch.Tensor]:
    group = dist.new_group(list(range(dist.get_world_size())))
    assert (shm.set_backend(group, path) is not None) == (path == "shm")
    n, r = dist.get_world_size(), dist.get_rank()
    outs = []
    for payload in compress.PAYLOADS:
        for count in (1, 63, 577, 70_001):
            xs = [data(j, count) for j in range(n)]
            exact = sum(x.double() for x in xs)
            got = comm.all_reduce(xs[r].clone(), group, payload=payload)
            err = (got.double() - exact).abs()
            assert (err <= bound(xs, payload)).all(), (payload, count, (err - bound(xs, payload)).max())
            if count > 1:
                assert err.max() > 0, "no error at all: the payload was not compressed"
            outs.append(got)
            # all-gather, uneven: rank j holds count + j elements, gathered in x's dtype
            shards = [data(10 + j, count + j) for j in range(n)]
            got = comm.all_gather(shards[r], group, sizes=[count + j for j in range(n)], payload=payload)
            full = torch.cat(shards)
            assert got.dtype == torch.float32 and got.shape == full.shape
            assert ((got - full).abs() <= torch.cat([bound([s], payload) for s in shards])).all()
    with pytest.raises(ValueError, match="payload='fp8'"):
        comm.all_reduce(torch.ones(3), group, payload="fp8")
    with pytest.raises(ValueError, match="op='sum' only"):
        comm.all_reduce(torch.ones(3), group, "max", payload="bf16")
    with pytest.raises(ValueError, match="floating-point"):
        comm.all_reduce(torch.ones(3, dtype=torch.int64), group, payload="int8")
    return outs


@pytest.mark.parametrize("world,path", [(2, "shm"), (3, "shm"), (3, "gloo")])
def test_payloads_within_their_bounds_and_identical_on_every_rank(world, path):
    results = run_ranks(world, payload_checks, path)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_encodings_round_trip_within_bounds():
    x = torch.randn(1000) * 3
    for payload in compress.PAYLOADS:
        back = compress.decode(compress.encode(x, payload), payload, x.numel())
        assert ((back - x).abs() <= bound([x], payload)).all()
        assert compress.encode(x, payload).numel() == compress.encoded_bytes(x.numel(), payload)
    assert compress.encoded_bytes(576, "bf16") == 576 * 2
    assert compress.encoded_bytes(576, "int8") == 576 + 4 * 9

"""Weight offload (``--cpu-offload-gb N``, vLLM's flag): a model larger than the GPU's memory
runs with some of its decoder layers' weights held in pinned CPU memory.

Which layers: whole decoder layers from this rank's first onwards, until at least N GiB of
weights are on the host (vLLM takes parameters in the same order until the bytes are used up);
the embedding, the final norm and the LM head stay on the GPU.

How they run: before an offloaded layer runs, its weights are on the GPU. Each copy is started a
layer ahead on a side stream (``torch.cuda.Stream``), so the copy of layer k+1 runs while layer k
computes; the compute stream waits on the copy's event only when it needs it. After the layer,
its parameters point at the host copies again and the GPU copies are freed once the compute
stream is done with them (``record_stream``). A decode step therefore moves every offloaded
byte over PCIe once: with N GiB offloaded a step takes at least N GiB / the host-to-device
bandwidth (``benchmarks/offload.py`` prints both).

The GPU copies are new memory each step, which a CUDA graph cannot replay and which
``torch.compile`` would have to trace through hooks: an offloading run is eager (``Worker``),
and ``compile`` is refused with it (``EngineConfig.for_model``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

GIB = 1 << 30


class WeightOffload:
    """Places a model loaded on the CPU: ``prepare`` (int8 quantization, which is collective over
    tp and so runs on the GPU) is applied to each layer on the GPU, then the layer either stays
    there or, while fewer than ``budget`` bytes are offloaded, goes back to pinned host memory."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        budget: int,
        prepare: Callable[[nn.Module], None] | None = None,
    ):
        self.device = device
        self.layers: list[nn.Module] = []  # the offloaded layers, in the order they run
        self.hosted: list[list[tuple[nn.Parameter, torch.Tensor]]] = []  # per layer: its params and their host copies
        self.bytes = 0
        layers = list(getattr(model, "layers", []))
        others = [m for name, m in model.named_children() if name != "layers"]
        for m in others:
            m.to(device)
        for layer in layers:
            layer.to(device)
            if prepare is not None:
                prepare(layer)
            if self.bytes < budget:
                self._host(layer)
        torch.cuda.empty_cache()  # the offloaded layers' passage through the GPU (int8) leaves nothing cached
        self.largest_layer = max((sum(h.nbytes for _, h in params) for params in self.hosted), default=0)
        """Bytes of the largest offloaded layer: a step holds two at once (one computing, one copying)."""
        self.stream = torch.cuda.Stream(device)
        self.in_flight: dict[int, tuple[torch.cuda.Event, list[torch.Tensor]]] = {}
        for k, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(partial(self._enter, k))
            layer.register_forward_hook(partial(self._leave, k))

    def _host(self, layer: nn.Module) -> None:
        params = []
        for p in layer.parameters():
            host = p.data.to("cpu").pin_memory()
            p.data = host
            params.append((p, host))
            self.bytes += host.numel() * host.element_size()
        self.layers.append(layer)
        self.hosted.append(params)

    def _fetch(self, k: int) -> None:
        """Start copying layer k's weights to the GPU on the side stream (once)."""
        if k in self.in_flight:
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # after what freed the memory it reuses
        with torch.cuda.stream(self.stream):
            copies = [host.to(self.device, non_blocking=True) for _, host in self.hosted[k]]
            done = torch.cuda.Event()
            done.record(self.stream)
        self.in_flight[k] = (done, copies)

    def _enter(self, k: int, module, args) -> None:
        self._fetch(k)
        done, copies = self.in_flight.pop(k)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(done)
        for (p, _), gpu in zip(self.hosted[k], copies):
            gpu.record_stream(compute)  # made on the side stream, used on this one
            p.data = gpu
        self._fetch((k + 1) % len(self.layers))  # the next one while this one computes

    def _leave(self, k: int, module, args, output) -> None:
        for p, host in self.hosted[k]:
            p.data = host

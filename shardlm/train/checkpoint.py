"""A trained model back in the checkpoint's own names, and saved as a HF model directory.

Each parallel layer knows which rows or columns of which checkpoint tensor it holds (the same
``sources`` it loads from), so the pieces of all tp ranks put together are the HF tensors.
Saving gathers them on rank 0 (which therefore holds the whole model once) and writes
``model.safetensors``, ``config.json`` and the tokenizer: the directory loads in shardlm
(``--model DIR``) and in HF transformers. A GGUF source is saved the same way (float32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardlm.models.tokenizer import TokenizerError
from shardlm.parallel.expert import ExpertParallelSwiGLU
from shardlm.parallel.tensor import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    whole_tensors,
)


@dataclass
class Piece:
    """``tensor`` is ``name``[rows, cols] of the checkpoint (None: the whole dim)."""

    name: str
    rows: slice | None
    cols: slice | None
    tensor: torch.Tensor


def pieces(model: nn.Module, *, dense: bool = True, experts: bool = True) -> list[Piece]:
    """This rank's parameters as pieces of checkpoint tensors (copies, detached): the routed
    experts' (``experts``), the others' (``dense``)."""
    out = []
    for m in model.modules():
        if isinstance(m, ExpertParallelSwiGLU):
            if experts:
                for name, w, first, count, at in m.expert_blocks():
                    block = w.view(-1, w.shape[-1])[first : first + count]
                    if w is m.w13:  # gate / up rows
                        out.append(Piece(name, slice(at[0], at[0] + count), None, block))
                    else:  # down columns
                        out.append(Piece(name, None, slice(at[1], at[1] + w.shape[-1]), block))
            continue
        if not dense:
            continue
        if isinstance(m, ColumnParallelLinear):
            start = 0
            for (name, rows), n in zip(m.sources, m.out_sizes):
                out.append(Piece(f"{name}.weight", rows, None, m.weight[start : start + n]))
                if m.bias is not None:
                    out.append(Piece(f"{name}.bias", rows, None, m.bias[start : start + n]))
                start += n
        elif isinstance(m, RowParallelLinear):
            out.append(Piece(f"{m.source}.weight", None, m.cols, m.weight))
            if m.bias is not None:
                out.append(Piece(f"{m.source}.bias", None, None, m.bias))
        elif isinstance(m, (VocabParallelEmbedding, ParallelLMHead)) and m.source is not None:
            out.append(Piece(f"{m.source}.weight", m.rows, None, m.weight))
        out.extend(Piece(name, None, None, p) for name, p in whole_tensors(m))
    for p in out:
        p.tensor = p.tensor.detach().to("cpu", copy=True)  # gathered as objects: no GPU tensor in a pickle
    return out


def assemble(all_pieces: list[Piece]) -> dict[str, torch.Tensor]:
    """Whole tensors from the pieces of every tp rank (and stage: a tied embedding comes twice)."""
    by_name: dict[str, dict[tuple, Piece]] = {}
    key_of = lambda p: (p.rows.start if p.rows else 0, p.cols.start if p.cols else 0)
    for p in all_pieces:
        by_name.setdefault(p.name, {})[key_of(p)] = p
    out = {}
    for name, unique in by_name.items():
        parts = list(unique.values())
        if parts[0].rows is not None:
            out[name] = torch.cat([p.tensor for p in sorted(parts, key=lambda p: key_of(p)[0])])
        elif parts[0].cols is not None:
            out[name] = torch.cat([p.tensor for p in sorted(parts, key=lambda p: key_of(p)[1])], dim=1)
        else:  # replicated on every tp rank
            out[name] = parts[0].tensor
    return out


def hf_config(checkpoint) -> dict:
    """The saved model's config.json: a HF source's own (every field it had, MoE and MLA ones
    included), or one written from a GGUF file's metadata."""
    return dict(checkpoint.config.extra) if checkpoint.kind == "hf" else checkpoint.config.to_hf()


def save(model: nn.Module, checkpoint, dims, directory: str | Path) -> None:
    """Write the model as a HF directory. Collective: every rank calls it with the model's whole
    (tp-shard) weights in place; the pieces of one replica (dp and cp rank 0) go to global rank 0,
    which writes."""
    from safetensors.torch import save_file

    # one replica's dense weights; the experts from the ranks of every slice's first copy
    first = dims.cp_rank == 0
    mine = pieces(model, dense=first and dims.dp_rank == 0, experts=first and dims.edp_rank == 0)
    everything: list | None = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everything = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, everything, dst=0)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    assert everything is not None  # rank 0 gathered every rank's pieces
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in assemble([p for part in everything for p in part]).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_config(checkpoint), indent=2))
    try:
        tokenizer = checkpoint.tokenizer()
    except TokenizerError:  # the source has none (e.g. a bare test model): neither does the copy
        return
    tokenizer.save(directory)

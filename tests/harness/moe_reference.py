"""HF references for the tiny MoE models of ``reference.TINY_MOE_MODELS``.

Besides HF's greedy tokens, a reference records the logits at every position of every
prompt (dp ranks score different prompts) and the two margins that make exact token
comparison meaningful: the smallest top-1/top-2 logit gap of the greedy choices and the
smallest gap between the k-th and (k+1)-th router logit over every routed token (a
thinner one would let float32 noise change an expert choice, which no layout can match).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.reference import NEW_TOKENS, PROMPTS, TINY_MOE_MODELS


@dataclass
class MoEReference:
    path: Path
    config: object  # the transformers config
    tokens: list[list[int]]  # greedy continuation of each prompt
    logits: list[torch.Tensor]  # [len(prompt), vocab] for each prompt
    token_margin: float
    router_margin: float


def hf_model(name: str, *, seed: int = 0):
    import transformers

    cls_name, kwargs = TINY_MOE_MODELS[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    for r in routers(model):  # HF starts DeepSeek-V3's correction bias at zero: make it steer
        if hasattr(r, "e_score_correction_bias"):
            r.e_score_correction_bias.copy_(0.05 * torch.randn(r.e_score_correction_bias.shape))
    return model


def routers(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")]


def choice_margin(router, logits: torch.Tensor) -> float:
    """The smallest gap, over tokens, that a router's choice rests on: between the k-th and
    (k+1)-th score, and for group-limited routers (DeepSeek) also between the last group taken
    and the next, and the k-th and (k+1)-th score within the groups taken."""
    logits = logits.float()
    k = router.top_k
    if not hasattr(router, "num_group"):
        s = logits.sort(dim=-1, descending=True).values
        return (s[:, k - 1] - s[:, k]).min().item()
    bias = getattr(router, "e_score_correction_bias", None)
    v3 = bias is not None
    scores = logits.sigmoid() + bias if v3 else logits.softmax(dim=-1)
    grouped = scores.view(scores.shape[0], router.num_group, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1) if v3 else grouped.amax(-1)
    g = group_scores.sort(dim=-1, descending=True)
    gap_groups = (g.values[:, router.topk_group - 1] - g.values[:, router.topk_group]).min().item()
    taken = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, g.indices[:, : router.topk_group], True)
    s = grouped.masked_fill(~taken[..., None], float("-inf")).flatten(1).sort(dim=-1, descending=True).values
    return min(gap_groups, (s[:, k - 1] - s[:, k]).min().item())


def build_tiny_moe(name: str, directory: Path) -> MoEReference:
    """Save a random HF MoE model as safetensors and record its outputs on PROMPTS."""
    model = hf_model(name)
    model.save_pretrained(directory, safe_serialization=True)
    gaps: list[float] = []

    def hook(module, args, out):
        gaps.append(choice_margin(module, out[0]))  # out[0]: router logits [tokens, experts]

    handles = [r.register_forward_hook(hook) for r in routers(model)]
    tokens, logits, token_gaps = [], [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS)
            tokens.append(out[0, len(p) :].tolist())
            full = model(out).logits[0].float()  # the routers see every generated token here too
            top2 = full[len(p) - 1 : -1].topk(2, dim=-1).values
            token_gaps.append((top2[:, 0] - top2[:, 1]).min().item())
            logits.append(full[: len(p)])
    for h in handles:
        h.remove()
    return MoEReference(directory, model.config, tokens, logits, min(token_gaps), min(gaps))


_built: dict[str, MoEReference] = {}


def cached_tiny_moe(name: str, tmp_path_factory) -> MoEReference:
    """build_tiny_moe once per test session (the MoE test modules share the builds)."""
    if name not in _built:
        _built[name] = build_tiny_moe(name, tmp_path_factory.mktemp(name))
    return _built[name]


# Expert-parallel folds of dp x tp (and pp, cp) that the group tests walk through.
FOLDS = [
    dict(dp=2, tp=2, ep=2),
    dict(dp=2, tp=2, ep=4),
    dict(dp=2, tp=2, ep=2, etp=2),
    dict(tp=4, ep=2, etp=2),
    dict(pp=2, tp=2, ep=2),
    dict(dp=3, tp=2, ep=3),
    dict(dp=2, pp=2, cp=2, tp=2, ep=2, etp=2),
]

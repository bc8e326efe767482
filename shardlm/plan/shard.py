"""Parameters one rank holds under TP / PP / EP, exactly as shardlm shards them.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053 §3)
in shardlm allows any tp up to the number of query heads:

* query heads split as evenly as possible, the first ``n % tp`` ranks get one more;
* a rank holds every KV head its query heads read, so a KV head whose group straddles two
  ranks is replicated on both (GQA, Ainslie et al. 2023, https://arxiv.org/abs/2305.13245);
* MLP rows and vocabulary rows split with a remainder the same way.

Pipeline stages take contiguous runs of layers (split the same way); the embedding lives
on the first stage and the LM head plus final norm on the last (a tied head is a second
copy there when pp > 1, as Megatron-LM does). Routed experts split over ep ranks and
each expert's rows over etp ranks; the router and MLA's down-projections are replicated.
Memory is that of the *largest* rank, since every rank must fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlm.models.config import ModelConfig
from shardlm.parallel.pipeline import stage_layers
from shardlm.plan.errors import PlanError


def split_even(n: int, parts: int) -> list[int]:
    """n split into ``parts`` sizes as even as possible; the first ``n % parts`` get one more."""
    q, r = divmod(n, parts)
    return [q + 1 if i < r else q for i in range(parts)]


def head_split(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """(query heads, KV heads) each tp rank holds; KV heads shared across ranks are replicated."""
    q_per_kv = num_heads // num_kv_heads
    out, start = [], 0
    for n in split_even(num_heads, tp):
        stop = start + n
        kv = (stop - 1) // q_per_kv - start // q_per_kv + 1
        out.append((n, kv))
        start = stop
    return out


@dataclass(frozen=True)
class RankLayer:
    """One decoder layer as the largest tp/ep rank holds it (parameter counts)."""

    attn: int
    """Attention parameters, norms and biases included."""
    dense: int
    """Dense MLP or shared-expert parameters (every token uses all of them)."""
    router: int
    """MoE router parameters (replicated)."""
    experts: int
    """Routed experts held by the largest ep rank."""
    expert_params: int
    """Parameters of one routed expert's slice on this rank (rows split over etp)."""
    q_heads: int
    """Query heads on the rank."""
    kv_heads: int
    """KV heads on the rank (0 for MLA, whose latent cache is replicated instead)."""

    @property
    def total(self) -> int:
        return self.attn + self.dense + self.router + self.experts * self.expert_params


def _attention_params(cfg: ModelConfig, q: int, kv: int) -> int:
    h = cfg.hidden_size
    norms = 2 * h  # input and post-attention RMSNorm
    if cfg.is_mla:  # DeepSeek-V2/V3 MLA, https://arxiv.org/abs/2405.04434 §2.1
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_part = (h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * q * qk) if cfg.q_lora_rank else h * q * qk
        kv_part = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
        kv_part += cfg.kv_lora_rank * q * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        return norms + q_part + kv_part + q * cfg.v_head_dim * h
    d = cfg.head_dim
    p = norms + h * d * (q + 2 * kv) + q * d * h
    if cfg.qkv_bias:
        p += d * (q + 2 * kv)
    if cfg.o_bias:
        p += h
    if cfg.qk_norm:
        p += 2 * d
    return p


def _mlp_params(cfg: ModelConfig, rows: int) -> int:
    """An MLP with ``rows`` intermediate rows: SwiGLU (gate, up, down), or GPT's (fc, proj)."""
    mats = 3 if cfg.gated_mlp else 2
    return mats * cfg.hidden_size * rows + (((mats - 1) * rows + cfg.hidden_size) if cfg.mlp_bias else 0)


def is_moe_layer(cfg: ModelConfig, layer: int) -> bool:
    return cfg.is_moe and layer >= cfg.first_k_dense


def rank_layer(cfg: ModelConfig, layer: int, *, tp: int, ep: int = 1, etp: int = 1) -> RankLayer:
    """The largest tp rank's share of decoder layer ``layer``."""
    heads = head_split(cfg.num_heads, cfg.num_kv_heads, tp)
    moe = is_moe_layer(cfg, layer)
    ffn = cfg.shared_expert_intermediate_size if moe else cfg.intermediate_size
    rows = split_even(ffn, tp) if ffn else [0] * tp
    best = None
    for (q, kv), r in zip(heads, rows):
        attn = _attention_params(cfg, q, 0 if cfg.is_mla else kv)
        dense = _mlp_params(cfg, r) if r else 0
        if best is None or attn + dense > best[0] + best[1]:
            best = (attn, dense, q, 0 if cfg.is_mla else kv)
    assert best is not None  # the loop saw at least one tp rank
    attn, dense, q, kv = best
    if not moe:
        return RankLayer(attn=attn, dense=dense, router=0, experts=0, expert_params=0, q_heads=q, kv_heads=kv)
    experts = split_even(cfg.num_experts, ep)[0]
    expert_rows = split_even(cfg.moe_intermediate_size, etp)[0]
    return RankLayer(
        attn=attn,
        dense=dense,
        router=cfg.hidden_size * cfg.num_experts,
        experts=experts,
        expert_params=_mlp_params(cfg, expert_rows),
        q_heads=q,
        kv_heads=kv,
    )


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    return split_even(cfg.vocab_size, tp)[0]


def stage_params(cfg: ModelConfig, *, tp: int, pp: int, ep: int = 1, etp: int = 1) -> list[int]:
    """Parameters on the largest rank of each pipeline stage."""
    embed = vocab_rows(cfg, tp) * cfg.hidden_size
    cache: dict[bool, int] = {}
    out = []
    for s, layers in enumerate(stage_layers(cfg, pp)):
        total = 0
        for layer in layers:
            moe = is_moe_layer(cfg, layer)
            if moe not in cache:
                cache[moe] = rank_layer(cfg, layer, tp=tp, ep=ep, etp=etp).total
            total += cache[moe]
        if s == 0:
            total += embed
        if s == pp - 1:
            total += cfg.hidden_size  # final norm
            if not cfg.tie_word_embeddings or pp > 1:
                total += embed
        out.append(total)
    return out


def total_params(cfg: ModelConfig) -> int:
    """All parameters of the model (tied embeddings counted once)."""
    return stage_params(cfg, tp=1, pp=1)[0]


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token's forward pass multiplies (top-k experts, one LM head)."""
    total = vocab_rows(cfg, 1) * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size
    return total + sum(layer_active_params(cfg, layer) for layer in range(cfg.num_layers))


def layer_active_params(cfg: ModelConfig, layer: int) -> int:
    """Parameters one token multiplies in decoder layer ``layer``: its attention, dense MLP, router
    and top-k experts."""
    rl = rank_layer(cfg, layer, tp=1)
    return rl.attn + rl.dense + rl.router + min(cfg.num_experts_per_tok, rl.experts) * rl.expert_params


def largest_layer_params(cfg: ModelConfig) -> int:
    """The biggest single module (DeepSpeed's ``largest_layer_params``): a decoder layer or the embedding."""
    kinds = {is_moe_layer(cfg, i): i for i in range(cfg.num_layers)}  # one layer of each kind
    return max([rank_layer(cfg, i, tp=1).total for i in kinds.values()] + [cfg.vocab_size * cfg.hidden_size])


@dataclass(frozen=True)
class Kept16:
    """Shares of a quantized checkpoint's decoder layers whose attention and whose MLP (dense,
    shared and routed experts) stay 16-bit: the layers its ``quantization_config`` leaves out
    (``kept_16bit``). Serving engines quantize linear layers only, so the embedding and the LM head
    are 16-bit in every quantized plan whatever the list says (``weight_bytes``)."""

    attention: float = 0.0
    mlp: float = 0.0


NOTHING_KEPT = Kept16()
"""An unquantized plan's (or a quantized checkpoint's that keeps no module 16-bit)."""


def mixed_bytes(narrow: float, wide: float, share: float) -> float:
    """Bytes a parameter of a module kind costs when ``share`` of it is kept ``wide`` (``Kept16``) and
    the rest is ``narrow``."""
    return wide * share + narrow * (1 - share)


KEPT_FORMS = "lm_head, [model.]layers.N, [model.]layers.N.self_attn, [model.]layers.N.mlp"


def kept_16bit(cfg: ModelConfig) -> Kept16:
    """Which modules a quantized checkpoint keeps in 16-bit, from its config.json's
    ``quantization_config``: ``modules_to_not_convert`` (transformers' quantizers, e.g. fbgemm_fp8,
    as Meta's Llama 3.1 405B FP8 keeps its attention and first and last layers,
    https://github.com/huggingface/huggingface-llama-recipes, llama-405B-FP8.py) or ``ignore``
    (compressed-tensors). An entry the planner cannot place is refused, not skipped."""
    qc = cfg.extra.get("quantization_config") or {}
    names = qc.get("modules_to_not_convert") or qc.get("ignore") or []
    attention: set[int] = set()
    mlp: set[int] = set()
    for name in names:
        parts = name.removeprefix("model.").split(".")
        if parts == ["lm_head"]:
            continue  # 16-bit in any case
        if len(parts) in (2, 3) and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < cfg.num_layers:
            layer, part = int(parts[1]), parts[2] if len(parts) == 3 else None
            if part in (None, "self_attn"):
                attention.add(layer)
            if part in (None, "mlp"):
                mlp.add(layer)
            if part in (None, "self_attn", "mlp"):
                continue
        raise PlanError(
            f"quantization_config lists {name!r} among the modules it keeps unquantized; the planner "
            f"places only whole modules: {KEPT_FORMS} (N < {cfg.num_layers}). List whole modules, or "
            "plan without the quantization_config"
        )
    return Kept16(len(attention) / cfg.num_layers, len(mlp) / cfg.num_layers)


def mla_up_projections(cfg: ModelConfig, rl: RankLayer) -> tuple[tuple[int, int], ...]:
    """(K, N) of latent attention's up-projections on the rank: the query's from its latent (where the
    query has one) and the keys' and values' from theirs."""
    query = ((cfg.q_lora_rank, rl.q_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)),) if cfg.q_lora_rank else ()
    return (*query, (cfg.kv_lora_rank, rl.q_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)))


def gemm_shapes(cfg: ModelConfig, rl: RankLayer) -> dict[str, tuple[tuple[int, int], ...]]:
    """(K, N) of each linear layer's product on the rank (input width, output width), by part:
    ``attn`` (qkv and o; MLA's q_a, q_b, kv_a, kv_b and o), ``dense`` (the dense MLP or shared
    experts: a gated MLP's gate and up as one product) and ``expert`` (one routed expert's)."""
    h, q = cfg.hidden_size, rl.q_heads
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        ups = mla_up_projections(cfg, rl)  # the query's (with a latent) and the keys' and values'
        query = [(h, cfg.q_lora_rank), ups[0]] if cfg.q_lora_rank else [(h, q * qk)]
        attn = [*query, (h, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ups[-1], (q * cfg.v_head_dim, h)]
    else:
        attn = [(h, (q + 2 * rl.kv_heads) * cfg.head_dim), (q * cfg.head_dim, h)]
    up = 2 if cfg.gated_mlp else 1

    def mlp(rows: int) -> tuple[tuple[int, int], ...]:
        return ((h, up * rows), (rows, h)) if rows else ()

    dense_rows = rl.dense // ((up + 1) * h)
    expert_rows = rl.expert_params // ((up + 1) * h)
    return {"attn": tuple(attn), "dense": mlp(dense_rows), "expert": mlp(expert_rows)}

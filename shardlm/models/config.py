"""ModelConfig: the architecture of a decoder-only model, from HF config.json or GGUF metadata.

One dataclass serves the runtime model and the planner; ``check_supported()`` says what the
runtime can run (the planner sizes more).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shardlm.errors import UsageError

# HF `architectures[0]` -> family. The family decides the few places models differ.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
RUNTIME_FAMILIES = tuple(ARCHITECTURES.values())
# families the planner costs but the runtime does not run: GPT's LayerNorm + GELU 4h MLP (GPT-2's
# config.json; the GPT-3 preset uses its format)
ARCHITECTURES["GPT2LMHeadModel"] = "gpt2"
MODEL_TYPES = {fam: fam for fam in ARCHITECTURES.values()}
DEEPSEEK = ("deepseek_v2", "deepseek_v3")


class ConfigError(UsageError):
    """A model description shardlm cannot use, with the reason and a way forward."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str
    """Architecture family: llama, mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, deepseek_v2,
    deepseek_v3."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    """Width of the dense MLP (gate/up output)."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA when fewer than num_heads)."""
    head_dim: int
    """Width of a query/key head; for MLA, HF's convention: the RoPE part's (qk_rope_head_dim)."""
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    """HF rope parameters beyond theta, e.g. {"rope_type": "llama3", "factor": 8.0, ...}."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2; Llama's attention_bias)."""
    o_bias: bool = False
    """Bias on the attention output projection (Llama's attention_bias)."""
    mlp_bias: bool = False
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    sliding_window: int | None = None
    """Attend only to the last `sliding_window` positions (Mistral v0.1)."""
    hidden_act: str = "silu"
    gated_mlp: bool = True
    """A gated MLP (SwiGLU: gate, up and down matrices), else two matrices around the activation
    (GPT's GELU MLP; planner only)."""
    dropout: bool = False
    """Trained with dropout (GPT's configs): its masks are activations a layer keeps (planner only)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # ---- mixture of experts ----
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of one routed expert's SwiGLU."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert(s) every token also takes (Qwen2-MoE's, gated; DeepSeek's
    n_shared_experts x moe_intermediate_size; 0: none)."""
    first_k_dense: int = 0
    """Leading layers that keep a dense MLP (DeepSeek's first_k_dense_replace)."""
    decoder_sparse_step: int = 1
    """Every this-many-th layer is MoE, the rest dense (Qwen-MoE's decoder_sparse_step)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers that keep a dense MLP in an MoE model (Qwen-MoE's mlp_only_layers)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to one."""
    scoring_func: str = "softmax"
    """Router scores: softmax over experts, or each expert's sigmoid (DeepSeek-V3)."""
    topk_method: str = "greedy"
    """'greedy' top-k, or 'group_limited': the top-k among the experts of the ``topk_group``
    best of ``n_group`` expert groups (DeepSeek-V2 scores a group by its best expert, V3 by its two best)."""
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' weights (DeepSeek)."""
    # ---- multi-head latent attention (DeepSeek-V2/V3, https://arxiv.org/abs/2405.04434 §2.1) ----
    kv_lora_rank: int = 0
    """Width of the compressed KV latent c_kv (0: not MLA)."""
    q_lora_rank: int = 0
    """Width of the compressed query (0: q is projected directly, as DeepSeek-V2-Lite)."""
    qk_rope_head_dim: int = 0
    """Width of each head's rotary part of q and k (the key's is shared by all heads)."""
    qk_nope_head_dim: int = 0
    """Width of each head's non-rotary part of q and k."""
    v_head_dim: int = 0
    rope_interleave: bool = False
    """The rotary dims come as interleaved pairs (DeepSeek's checkpoints) rather than two halves."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def checkpoint_dtype(self) -> str:
        """The weights' dtype as the checkpoint states it (config.json's torch_dtype, or dtype as
        transformers >= 5 writes it); float32 where it states none, as for GGUF's dequantized weights."""
        stated = self.extra.get("torch_dtype") or self.extra.get("dtype")
        return stated if stated in ("float32", "bfloat16", "float16") else "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "every KV head must serve the same number of query heads"
            )

    # ---- derived -------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def rotary_dim(self) -> int:
        """Width RoPE rotates: a head's, or MLA's rotary part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has routed experts (else a dense MLP)."""
        return (
            self.is_moe
            and index >= self.first_k_dense
            and index not in self.mlp_only_layers
            and (index + 1) % max(self.decoder_sparse_step, 1) == 0
        )

    def check_supported(self) -> None:
        """Raise unless the runtime model can run this config."""
        if self.family not in RUNTIME_FAMILIES:
            raise ConfigError(
                f"architecture family {self.family!r} is not runnable yet; shardlm runs "
                f"{', '.join(RUNTIME_FAMILIES)} (the planner still accepts it)"
            )
        if self.is_moe and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}"
            )
        if self.shared_expert_intermediate_size and self.family not in ("qwen2_moe", *DEEPSEEK):
            raise ConfigError(
                f"a shared expert (shared_expert_intermediate_size="
                f"{self.shared_expert_intermediate_size}) is implemented for qwen2_moe and DeepSeek only"
            )
        if self.is_moe and self.num_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} does not divide the {self.num_experts} experts into groups")
        if self.is_moe and not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} must be between 1 and n_group={self.n_group}")
        per_group = self.num_experts // self.n_group if self.is_moe else 0
        if self.topk_method == "group_limited" and self.topk_group * per_group < self.num_experts_per_tok:
            raise ConfigError(
                f"topk_group={self.topk_group} of n_group={self.n_group} groups leaves fewer experts than "
                f"num_experts_per_tok={self.num_experts_per_tok} to choose from; raise topk_group"
            )
        if self.family == "deepseek_v3" and self.is_moe and per_group < 2:
            raise ConfigError(f"DeepSeek-V3 scores a group by its two best experts; n_group={self.n_group} leaves one")
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported; shardlm runs SwiGLU (silu) MLPs")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in ("default", "llama3", "linear", "yarn"):
            raise ConfigError(f"rope_type={rope_type!r} is not supported; use default, linear, llama3 or yarn")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    def to_hf(self) -> dict[str, Any]:
        """A HF ``config.json`` for this model (dense families; ``from_hf`` reads it back equal)."""
        if self.is_moe or self.family not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ConfigError(
                f"writing a HF config for family {self.family!r} is not supported; "
                f"dense llama, mistral, qwen2 and qwen3 are"
            )
        arch = next(a for a, f in ARCHITECTURES.items() if f == self.family)
        eos = list(self.eos_token_ids)
        cfg = {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
            "torch_dtype": "float32",
        }
        if self.rope_scaling:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        if self.family == "llama":
            cfg.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.sliding_window is not None:
            cfg.update(sliding_window=self.sliding_window, use_sliding_window=True)
        return cfg

    # ---- constructors ----------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the parsed contents of a HF ``config.json``."""
        archs = cfg.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        family = family or MODEL_TYPES.get(cfg.get("model_type", ""))
        if family is None:
            runs = ", ".join(sorted(a for a, f in ARCHITECTURES.items() if f in RUNTIME_FAMILIES))
            costs = ", ".join(sorted(a for a, f in ARCHITECTURES.items() if f not in RUNTIME_FAMILIES))
            raise ConfigError(
                f"unknown architecture {archs or cfg.get('model_type')!r}; shardlm runs {runs} (the planner also {costs})"
            )
        if family == "gpt2":  # GPT-2's names; biases everywhere, a tied head, the MLP 4h unless n_inner says
            h = cfg["n_embd"]
            cfg = {
                **cfg,
                "hidden_size": h,
                "num_hidden_layers": cfg["n_layer"],
                "num_attention_heads": cfg["n_head"],
                "intermediate_size": cfg.get("n_inner") or 4 * h,
                "max_position_embeddings": cfg.get("n_positions", 1024),
                "hidden_act": cfg.get("activation_function", "gelu_new"),
                "tie_word_embeddings": cfg.get("tie_word_embeddings", True),
                "attention_bias": True,
                "mlp_bias": True,
            }
        # transformers >= 5 writes rope settings into `rope_parameters` (theta included);
        # older files have `rope_theta` and `rope_scaling` side by side.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        if rope.get("rope_type", "default") == "default":
            rope = {}
        heads = cfg["num_attention_heads"]
        sliding = cfg.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen configs carry a window they do not use unless asked to
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
        attn_bias = bool(cfg.get("attention_bias", False))
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg.get("intermediate_size", 0) or 0,
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family in ("qwen2", "qwen2_moe") or attn_bias,
            o_bias=attn_bias and family in ("llama", "gpt2"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            hidden_act=cfg.get("hidden_act", "silu"),
            gated_mlp=family != "gpt2",
            dropout=any(cfg.get(k, 0.0) for k in ("resid_pdrop", "attn_pdrop", "hidden_dropout", "attention_dropout")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_experts=experts,
            num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if experts else 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size")
            or (cfg.get("intermediate_size", 0) if experts else 0),
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0)
            or (cfg.get("n_shared_experts", 0) or 0) * (cfg.get("moe_intermediate_size", 0) or 0),
            first_k_dense=cfg.get("first_k_dense_replace", 0) or 0,
            decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
            mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", family in ("mixtral", "deepseek_v3"))),
            scoring_func="sigmoid" if family == "deepseek_v3" else cfg.get("scoring_func", "softmax"),
            topk_method=_topk_method(family, cfg),
            n_group=cfg.get("n_group") or 1,
            topk_group=cfg.get("topk_group") or 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
            kv_lora_rank=cfg.get("kv_lora_rank") or 0,
            q_lora_rank=cfg.get("q_lora_rank") or 0,
            qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
            qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0,
            v_head_dim=cfg.get("v_head_dim") or 0,
            # HF's DeepSeek-V2 rotates interleaved pairs always (complex numbers), V3 when asked
            rope_interleave=family == "deepseek_v2" or bool(cfg.get("rope_interleave", False)),
            extra=cfg,
        )

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> ModelConfig:
        """Build from GGUF key/value metadata (llama-family files)."""
        arch = meta.get("general.architecture")
        families = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
        if arch not in families:
            raise ConfigError(f"GGUF architecture {arch!r} is not supported; shardlm reads {', '.join(families)}")

        def get(key: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{key}", default)

        heads = get("attention.head_count")
        hidden = get("embedding_length")
        vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        rope: dict[str, Any] = {}
        if get("rope.scaling.type") == "linear":
            rope = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
        return cls(
            family=families[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=get("feed_forward_length"),
            num_layers=get("block_count"),
            num_heads=heads,
            num_kv_heads=get("attention.head_count_kv") or heads,
            head_dim=get("attention.key_length") or hidden // heads,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope or None,
            max_position_embeddings=get("context_length", 4096),
            # tie_word_embeddings: GGUF says it by leaving out output.weight; the loader sets it
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (eos,),
            extra={},
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            return cls.from_hf(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read model config {str(path)!r}: {e}") from None
        except KeyError as e:
            raise ConfigError(f"{str(path)!r} lacks the field {e}; is it a decoder-only HF config.json?") from None


def _topk_method(family: str, cfg: dict[str, Any]) -> str:
    """DeepSeek-V3 always limits the choice to its best groups (n_group = 1: no limit); V2 when its
    ``topk_method`` says so; the other families pick greedily."""
    method = cfg.get("topk_method", "greedy")
    if family == "deepseek_v3" or method in ("group_limited_greedy", "noaux_tc"):
        return "group_limited"
    if method != "greedy":
        raise ConfigError(f"topk_method={method!r} is not supported; shardlm routes greedy or group-limited top-k")
    return method

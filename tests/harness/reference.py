"""Reference models and outputs from HF ``transformers``, the implementation shardlm must match.

Tiny random models exercise every architecture feature shardlm implements (GQA with
head counts that tp does not divide, QKV bias, q/k norm, llama3 RoPE scaling, a
sliding window shorter than the prompts, tied embeddings, attention/MLP biases).
Weights use ``initializer_range=0.2``: with HF's default 0.02 a random model's
logits are so flat that greedy argmax flips on float32 rounding; at 0.2 the
smallest top-1/top-2 logit gap over these prompts is ~1e-2, far above the ~1e-5
differences that reduction order causes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

PROMPTS = [  # token ids of different lengths: 1 token, short, longer than every window
    [7],
    [11, 5, 99, 3, 42],
    [int(x) for x in torch.randint(0, 200, (17,), generator=torch.Generator().manual_seed(1))],
    [int(x) for x in torch.randint(0, 200, (33,), generator=torch.Generator().manual_seed(2))],
]
NEW_TOKENS = 32

_COMMON = dict(
    vocab_size=251,
    hidden_size=96,
    intermediate_size=200,
    num_hidden_layers=6,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# name -> (transformers config class name, overrides)
TINY_MODELS = {
    "llama": (
        "LlamaConfig",
        dict(
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            rope_theta=500000.0,
        ),
    ),
    "llama_bias": (
        "LlamaConfig",
        dict(num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    ),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=6, num_key_value_heads=3)),
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "mistral": ("MistralConfig", dict(num_attention_heads=6, num_key_value_heads=2, sliding_window=7)),
}


@dataclass
class Reference:
    path: Path
    tokens: list[list[int]]  # greedy continuation of each prompt
    logits: torch.Tensor  # [len(PROMPTS[-1]), vocab]: every position of the longest prompt


def build_tiny(name: str, directory: Path, **changes) -> Reference:
    """Save a random HF model as safetensors and record HF's greedy tokens and logits
    (``changes``: config fields to change, e.g. num_hidden_layers=2)."""
    import transformers

    cls_name, overrides = TINY_MODELS[name]
    config = getattr(transformers, cls_name)(**{**_COMMON, **overrides, **changes})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return _record(model, directory, PROMPTS)


def _record(model, directory: Path, prompts: list[list[int]], **generate_kw) -> Reference:
    tokens = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS, **generate_kw
            )
            tokens.append(out[0, len(p) :].tolist())
        logits = model(torch.tensor([prompts[-1]])).logits[0].float()
    ref = Reference(directory, tokens, logits)
    (directory / "reference.json").write_text(json.dumps({"tokens": tokens}))
    return ref


def word_tokenizer(directory: Path, vocab_size: int) -> None:
    """Give a tiny model directory a HF tokenizer: token i is the word ``w{i}``, so the server can
    turn ids into text and back (``decode([3, 7]) == "w3 w7"``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


SMOLLM2_QUESTIONS = [
    "Explain tensor parallelism in one paragraph.",
    "What is the capital of France?",
    "Write a haiku about GPUs.",
]


def load_hf_smollm2():
    """HF's own GGUF loading (dequantize, un-permute) of the embedded SmolLM2; slow (~30 s)."""
    from transformers import AutoModelForCausalLM

    from shardlm.models.registry import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def smollm2_reference(model, directory: Path, prompts: list[list[int]]) -> Reference:
    return _record(model, directory, prompts)


# Tiny MoE models (tests/harness/moe_reference.py builds them). Their routers' top-k choices must
# not be razor-thin either: with these seeds and initializer_range=0.2 the smallest gap
# between the k-th and (k+1)-th router logit over every routed token is >= 5e-4, while
# layouts move router logits by ~1e-6; moe_reference records and the tests assert it.
# qwen3_moe has 6 experts, so ep=4 splits them unevenly (2, 2, 1, 1). The DeepSeek models have MLA
# (V3 with a low-rank q, V2 without, as V2-Lite), a dense layer 0 (first_k_dense_replace), shared
# experts, group-limited routing (4 groups, 2 taken), 6 heads (tp=4 splits them 2, 2, 1, 1),
# V3 a random correction bias (moe_reference.hf_model) and YaRN RoPE with DeepSeek's mscale.
_MOE_COMMON = dict(_COMMON, num_hidden_layers=2)
TINY_MOE_MODELS = {
    "mixtral": (
        "MixtralConfig",
        dict(
            _MOE_COMMON,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=64,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            _MOE_COMMON,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_experts=8,
            num_experts_per_tok=4,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=128,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            _MOE_COMMON,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            norm_topk_prob=True,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        dict(
            _MOE_COMMON,
            num_attention_heads=6,
            num_key_value_heads=6,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            kv_lora_rank=32,
            q_lora_rank=48,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=24,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        dict(
            _MOE_COMMON,
            num_attention_heads=6,
            num_key_value_heads=6,
            n_routed_experts=8,
            n_shared_experts=2,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            n_group=4,
            topk_group=2,
            topk_method="group_limited_greedy",
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=24,
            v_head_dim=16,
        ),
    ),
}

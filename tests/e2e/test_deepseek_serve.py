"""DeepSeek-V3 (MLA + DeepSeekMoE) through ``shardlm serve`` at tp2 x pp2 with the official
``openai`` client: HF's greedy tokens, as text (the tiny model gets a word-per-id tokenizer)."""

from __future__ import annotations

import pytest

from harness.moe_reference import cached_tiny_moe
from harness.reference import PROMPTS, word_tokenizer
from harness.server_harness import ServerProcess

pytestmark = pytest.mark.slow


def test_deepseek_v3_serves_hf_tokens_at_tp2_pp2(tmp_path_factory):
    from openai import OpenAI
    from transformers import AutoTokenizer

    ref = cached_tiny_moe("deepseek_v3", tmp_path_factory)
    word_tokenizer(ref.path, ref.config.vocab_size)
    tok = AutoTokenizer.from_pretrained(ref.path)
    server = ServerProcess("--model", str(ref.path), "--tp", "2", "--pp", "2", "--threads", "1")
    try:
        client = OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(PROMPTS, ref.tokens):
            text = tok.decode(prompt)
            r = client.completions.create(model=str(ref.path), prompt=text, max_tokens=12, temperature=0)
            assert r.choices[0].text.split() == tok.decode(want[:12]).split(), prompt
            assert r.usage.prompt_tokens == len(prompt)
    finally:
        server.kill()

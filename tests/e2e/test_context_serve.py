"""``shardlm serve --cp 2`` with the official ``openai`` client: every sequence and its KV cache
striped over two ranks, HF's greedy tokens as text, and a cache that holds two ranks' worth of tokens."""

from __future__ import annotations

import pytest

from harness.reference import PROMPTS, build_tiny, word_tokenizer
from harness.server_harness import ServerProcess

pytestmark = pytest.mark.slow


def test_cp2_serves_hf_tokens_and_holds_two_ranks_of_cache(tmp_path):
    import openai
    from transformers import AutoTokenizer

    ref = build_tiny("llama", tmp_path)
    word_tokenizer(ref.path, 251)
    tok = AutoTokenizer.from_pretrained(ref.path)
    # 6 layers x (K, V) x 2 KV heads x head_dim 16 x 4 bytes = 1536 bytes a token: 2 blocks of 16 a rank
    server = ServerProcess("--model", str(ref.path), "--cp", "2", "--threads", "1", "--kv-cache-memory", "49152")
    try:
        assert (
            "2 blocks of 16 tokens on each of the 2 cp ranks" in server.log and "= 64 tokens per replica" in server.log
        )
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
        for prompt, want in zip(PROMPTS, ref.tokens):  # up to 33 + 12 tokens: both ranks' blocks
            r = client.completions.create(model=str(ref.path), prompt=tok.decode(prompt), max_tokens=12, temperature=0)
            assert r.choices[0].text.split() == tok.decode(want[:12]).split(), prompt
        stream = client.completions.create(
            model=str(ref.path), prompt=tok.decode(PROMPTS[-1]), max_tokens=12, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream).split() == tok.decode(ref.tokens[-1][:12]).split()
        with pytest.raises(openai.BadRequestError, match=r"the KV cache 64 tokens \(--kv-cache-memory, or more --cp"):
            client.completions.create(model=str(ref.path), prompt="w1 " * 60, max_tokens=12)
    finally:
        server.kill()

"""A vLLM user's code and commands, the model swapped for what this machine has, run unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.cli import BIN, shardlm
from harness.reference import NEW_TOKENS, PROMPTS

QUICKSTART = """
from shardlm import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
llm = LLM(model="smollm2")
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    prompt = output.prompt
    generated_text = output.outputs[0].text
    print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
"""


@pytest.mark.slow  # ~17 s: SmolLM2 loaded in a fresh interpreter (make test's budget)
def test_vllms_offline_quickstart_runs_unchanged():
    """vLLM's quickstart (docs.vllm.ai, "Offline Batched Inference"), `from vllm` -> `from shardlm`
    and the model name swapped."""
    r = subprocess.run([sys.executable, "-c", QUICKSTART], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and all(line.startswith("Prompt: ") and "Generated text: " in line for line in lines)


@pytest.mark.slow  # ~9 s: a server process (make test's budget)
def test_a_hub_id_from_the_local_cache_serves_hf_tokens(tiny, tmp_path, monkeypatch):
    """`LLM("org/name")` as vLLM's, from the HF cache (huggingface_hub's layout), never downloaded."""
    import shutil

    from shardlm import LLM, SamplingParams

    ref = tiny("llama")
    snap = tmp_path / "models--acme--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(ref.path, snap)
    (tmp_path / "models--acme--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--acme--tiny-llama" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with LLM("acme/tiny-llama", threads=1) as llm:
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [o.token_ids for o in out] == ref.tokens
    r = subprocess.run(
        [str(BIN / "shardlm"), "generate", "--model", "acme/nothing-here", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HF_HUB_CACHE": str(tmp_path)},
    )
    assert r.returncode == 2 and f"is not in the HF cache {tmp_path}" in r.stderr


@pytest.mark.slow
def test_chat_template_and_generation_config(tmp_path):
    from shardlm import LLM

    template = tmp_path / "brief.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{% if add_generation_prompt %}:{% endif %}"
    )
    with LLM("smollm2", threads=1, chat_template=template.read_text()) as llm:
        ids = llm.encode_chat([{"role": "user", "content": "Hi"}])
        assert ids == llm.tokenizer.encode("<Hi>:", add_special_tokens=False)
        inline = llm.chat([{"role": "user", "content": "Hi"}], chat_template="[{{ messages[0]['content'] }}]")[0]
        assert inline.prompt_token_ids == llm.tokenizer.encode("[Hi]", add_special_tokens=False)
        assert llm.sampling_defaults == {}  # a GGUF file has no generation_config.json
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 5}))
    with LLM("smollm2", threads=1, generation_config=str(gen)) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.7, 5)
        assert len(llm.generate("Hello", None)[0].token_ids) == 5  # no params: the generation config's
    # shardlm generate: the config's defaults where no flag is given, a flag over the config (greedy:
    # the answer to "Hello" runs past 5 tokens)
    for flags, tokens in [((), 5), (("--max-new-tokens", "3"), 3)]:
        r = shardlm(
            "generate",
            "--generation-config",
            str(gen),
            "--json",
            "--threads",
            "1",
            "--temperature",
            "0",
            *flags,
            "Hello",
        )
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout.splitlines()[0])["completion_tokens"] == tokens

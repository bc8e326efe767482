"""Tokenizer against the real reference: transformers' tokenizer built from the same GGUF.

Tolerance: exact (ids, strings and the serialized backend must all be identical).
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import jinja2
import pytest

from shardlm.models.gguf import GGUFFile
from shardlm.models.registry import smollm2_gguf_path
from shardlm.models.tokenizer import PRE_TOKENIZER_SPLITS, IncrementalDecoder, Tokenizer, TokenizerError

PATH = smollm2_gguf_path()

CORPUS = [
    "",
    "Hello world",
    " Hello  world ",
    "The year 2024 had 366 days; 3.14159 and 1,000,000 and 0x1F.",
    "a  b   c    d\n\n\ne\t\tf \t \n g\r\nh",
    "    indented\n\tTab\n",
    'def f(x: int) -> int:\n    return {"k": [x ** 2, None]}  # comment\n',
    "I'm sure they'll say it's 'fine', won't they? DON'T!",
    "Emoji 😀👍🏽 and family 👨‍👩‍👧 and flags 🇫🇷",
    "中文分词测试，日本語のテキスト、한국어 문장.",
    "Ünïcödé façade naïve — “quotes” … ©®™",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>",
    "<|im_start <|im_end |> <repo_name>x<file_sep>",
    "   ",
    "\n",
    "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken…"},
        {"role": "user", "content": "中文 please 😀"},
    ],
]


@pytest.fixture(scope="module")
def gguf() -> GGUFFile:
    return GGUFFile(PATH)


@pytest.fixture(scope="module")
def ours(gguf) -> Tokenizer:
    return Tokenizer.from_gguf(gguf)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH.parent, gguf_file=PATH.name)  # ~10 s


def test_backend_is_identical_to_transformers_conversion(ours, hf):
    ours_json, hf_json = json.loads(ours.backend.to_str()), json.loads(hf.backend_tokenizer.to_str())
    assert ours_json == hf_json
    assert ours_json["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                          "use_regex": True}  # fmt: skip
    assert len(ours_json["added_tokens"]) == 17 and len(ours_json["model"]["merges"]) == 48900


def test_properties(ours, hf, gguf):
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_ids == (2,) and ours.backend.id_to_token(2) == "<|im_end|>" == hf.eos_token
    assert ours.vocab_size == len(hf) == 49152
    assert ours.chat_template == hf.chat_template == gguf.metadata["tokenizer.chat_template"]
    assert ours.special_tokens == hf.special_tokens_map


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_hf(ours, hf, text):
    for add in (True, False):
        assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add)


def test_encode_keeps_special_tokens_whole(ours):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert ours.encode("") == []


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(ours, hf, skip):
    rng = random.Random(0)
    samples = [ours.encode(t) for t in CORPUS] + [[rng.randrange(49152) for _ in range(40)] for _ in range(20)]
    samples += [[0, 1, 2, 3, 500, 16], []]
    for ids in samples:
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for text in CORPUS:  # round trip
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_hf(ours, hf, messages):
    for gen in (True, False):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want
    assert "You are a helpful AI assistant named SmolLM" in ours.apply_chat_template(CONVERSATIONS[0])


# Exercises the sandbox settings: trim_blocks/lstrip_blocks, loopcontrols, tojson (no HTML escaping),
# special-token variables, strftime_now, {% generation %}, raise_exception.
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if m['role'] == 'stop' %}{% break %}{% endif %}
    {% if m['role'] == 'skip' %}{% continue %}{% endif %}
  [{{ m['role'] }}] {{ m['content'] | tojson }}
    {% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{% if strftime_now('%Y') | length != 4 %}{{ raise_exception('bad year') }}{% endif %}
{% if add_generation_prompt %}<gen>{% endif %}"""


def test_custom_template_renders_like_hf(ours, hf):
    messages = [{"role": "user", "content": "<b>&'\"</b> ü"}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}, {"role": "stop", "content": ""},
                {"role": "user", "content": "never"}]  # fmt: skip
    for gen in (True, False):
        want = hf.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen, chat_template=TEMPLATE) == want
    assert "never" not in want and '"<b>&' in want


def test_template_errors(ours):
    with pytest.raises(jinja2.exceptions.TemplateError, match="no system"):
        ours.apply_chat_template([], chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template([], chat_template="{{ messages.append(1) }}")  # immutable sandbox
    bare = Tokenizer(ours.backend, bos_token_id=None, eos_token_ids=())
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template(CONVERSATIONS[0])


STREAM_TEXTS = ["中文分词测试😀👍🏽👨‍👩‍👧 café", "Emoji 😀 then ascii", "<|im_start|>x😀<|im_end|>y", "🇫🇷🇩🇪"]


@pytest.mark.parametrize("text", STREAM_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_stream_deltas_concatenate_to_decode(ours, text, skip):
    ids = ours.encode(text)
    dec = IncrementalDecoder(ours, skip_special_tokens=skip)
    deltas = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(deltas) == ours.decode(ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas)  # no broken character is ever emitted
    assert "".join(ours.decode_stream(ids, skip_special_tokens=skip)) == ours.decode(ids, skip_special_tokens=skip)


def test_stream_holds_back_split_characters(ours):
    ids = ours.encode("😀")
    assert len(ids) > 1  # one character, several byte-level tokens
    assert all("\ufffd" in ours.decode([i]) for i in ids)
    dec = IncrementalDecoder(ours)
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_stream_random_ids(ours):
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(49152) for _ in range(rng.randrange(1, 60))]
        assert "".join(ours.decode_stream(ids)) == ours.decode(ids)
        assert "".join(ours.decode_stream(ids, skip_special_tokens=False)) == ours.decode(ids, False)


def fake_gguf(gguf, **overrides):
    return SimpleNamespace(path="fake.gguf", metadata={**gguf.metadata, **overrides})


def test_bos_eos_metadata_honoured(gguf):
    tok = Tokenizer.from_gguf(fake_gguf(gguf, **{"tokenizer.ggml.add_bos_token": True,
                                                 "tokenizer.ggml.add_eos_token": True}))  # fmt: skip
    assert tok.encode("hi") == [1, *Tokenizer.from_gguf(gguf).encode("hi"), 2]
    assert tok.encode("hi", add_special_tokens=False) == Tokenizer.from_gguf(gguf).encode("hi")


def test_unsupported_gguf_tokenizers_say_what_works(gguf):
    with pytest.raises(TokenizerError, match="'llama'.*'gpt2'.*from_pretrained"):
        Tokenizer.from_gguf(fake_gguf(gguf, **{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(TokenizerError, match="'mystery'.*qwen2"):
        Tokenizer.from_gguf(fake_gguf(gguf, **{"tokenizer.ggml.pre": "mystery"}))


def test_pre_tokenizer_regexes_match_transformers():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    for pre, split in PRE_TOKENIZER_SPLITS.items():
        if split is not None:
            assert GGUF_PRE_TOKENIZER_SPLITS[pre] == split, pre
        else:
            assert pre not in GGUF_PRE_TOKENIZER_SPLITS  # transformers keeps ByteLevel's GPT-2 regex


def test_from_pretrained_directory(ours, hf, tmp_path):
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, (2,), 49152)
    for text in CORPUS:
        assert tok.encode(text) == ours.encode(text)
        assert tok.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert tok.apply_chat_template(CONVERSATIONS[1]) == ours.apply_chat_template(CONVERSATIONS[1])
    assert "".join(tok.decode_stream(ours.encode(STREAM_TEXTS[0]))) == STREAM_TEXTS[0]


def test_from_pretrained_errors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"holds no tokenizer.*config\.json"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(TokenizerError, match="no such directory"):
        Tokenizer.from_pretrained(tmp_path / "missing")


# ---- chat ids exactly as HF's apply_chat_template(..., tokenize=True) --------------------------

BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)  # writes the BOS itself, as Llama 3's template does
PLAIN_TEMPLATE = BOS_TEMPLATE.removeprefix("{{ bos_token }}")


def hf_dir(hf, directory, template: str, add_bos: bool):
    """A HF tokenizer directory with SmolLM2's vocabulary and ``template``; with ``add_bos`` its
    tokenizer adds the BOS (<|im_start|>, id 1) to every encoding itself, as Llama 3's does."""
    from transformers import AutoTokenizer

    hf.save_pretrained(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    bos = [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}] if add_bos else []
    a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [*bos, a],
        "pair": [*bos, a, b],
        "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    (directory / "chat_template.jinja").write_text(template)
    return AutoTokenizer.from_pretrained(directory)


def hf_chat_ids(tok, messages) -> list[int]:
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_ids_equal_hf_for_gguf_and_hf_directories(ours, hf, gguf, tmp_path, messages):
    # 1. the GGUF as shipped: no BOS added, a template without one
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages)
    # 2-3. HF directories whose tokenizer adds a BOS, with a template that writes one and one that does not
    for name, template in (("bos", BOS_TEMPLATE), ("plain", PLAIN_TEMPLATE)):
        theirs = hf_dir(hf, tmp_path / name, template, add_bos=True)
        mine = Tokenizer.from_pretrained(tmp_path / name)
        assert mine.encode("hi")[0] == 1 and theirs.encode("hi")[0] == 1  # both add the BOS to plain text
        assert mine.encode_chat(messages) == hf_chat_ids(theirs, messages)
    # 4. a GGUF whose metadata asks for a BOS, with the BOS-writing template: the same ids as HF's
    bos_gguf = Tokenizer.from_gguf(
        fake_gguf(gguf, **{"tokenizer.ggml.add_bos_token": True, "tokenizer.chat_template": BOS_TEMPLATE})
    )
    want = hf_chat_ids(hf_dir(hf, tmp_path / "gguf-ref", BOS_TEMPLATE, add_bos=True), messages)
    assert bos_gguf.encode_chat(messages) == want and want[:2] != [1, 1]
    # can fail: encoding the rendered text as a plain prompt doubles the BOS (the bug this guards)
    assert bos_gguf.encode(bos_gguf.apply_chat_template(messages))[:2] == [1, 1]

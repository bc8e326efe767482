"""Tokenizer: text <-> ids, chat templates, and streaming detokenization.

Two sources, one interface:

* ``Tokenizer.from_gguf(GGUFFile)`` builds the byte-level BPE straight from the file's
  ``tokenizer.ggml.*`` metadata with the ``tokenizers`` library, in well under a second. The result
  is identical (``backend.to_str()``) to what transformers' GGUF conversion builds
  (``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer`` + GPT2Tokenizer +
  ``add_gguf_special_tokens`` + ``set_split_regex``), without importing transformers (~4 s) or
  its conversion (~9 s).
* ``Tokenizer.from_pretrained(dir)`` wraps ``transformers.AutoTokenizer`` for an HF directory.

Chat templates render like transformers' ``apply_chat_template(..., tokenize=False)``: same jinja2
sandbox settings (``utils/chat_template_utils.py``) and the special tokens passed as variables.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from shardlm.errors import UsageError

__all__ = ["IncrementalDecoder", "Tokenizer", "TokenizerError"]

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
# End-of-turn tokens of common chat formats: stop generation when the template uses one.
_CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>")
# tokenizer.ggml.pre -> split regex, as transformers' GGUF_PRE_TOKENIZER_SPLITS; pre types whose
# vocabulary was learned with GPT-2's own regex (ByteLevel's built-in) map to None.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str | None, str | None] = {
    **dict.fromkeys([None, "default", "gpt2", "gpt-2", "smollm"]),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _QWEN2_SPLIT),
}


class TokenizerError(UsageError):
    """A tokenizer shardlm cannot build or use, with the reason and a way forward."""


class Tokenizer:
    """Text <-> token ids for one model. Build with ``from_gguf`` or ``from_pretrained``."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        hf: Any = None,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))  # deduplicated, in order
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        """``bos_token``/``eos_token``/``unk_token``/``pad_token`` strings; chat templates see them."""
        self._hf = hf  # a transformers tokenizer to delegate encode/decode to (from_pretrained)

    def save(self, directory: str | Path) -> None:
        """Write this tokenizer as a HF model directory holds it (``from_pretrained`` reads it back)."""
        directory = Path(directory)
        if self._hf is not None:
            self._hf.save_pretrained(str(directory))
            return
        self.backend.save(str(directory / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))

    # ---- constructors -------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, gguf: Any) -> Tokenizer:
        """Byte-level BPE from a ``GGUFFile``'s metadata (``tokenizer.ggml.model == "gpt2"``)."""
        meta = gguf.metadata
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise TokenizerError(
                f"{gguf.path}: tokenizer.ggml.model is {kind!r}; shardlm builds only 'gpt2' (byte-level BPE) "
                f"tokenizers from GGUF. Use Tokenizer.from_pretrained(<HF model dir>) for this model"
            )
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZER_SPLITS:
            known = ", ".join(sorted(k for k in PRE_TOKENIZER_SPLITS if k))
            raise TokenizerError(
                f"{gguf.path}: tokenizer.ggml.pre={pre!r} has no known split regex (known: {known}); "
                f"add it to PRE_TOKENIZER_SPLITS or use Tokenizer.from_pretrained(<HF model dir>)"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types: list[int] = meta.get("tokenizer.ggml.token_type") or []
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens written in raw UTF-8 rather than GPT-2's byte alphabet get respelled (as transformers does).
        vocab = {
            t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges", [])]
        bpe = models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False)  # fmt: skip
        backend = Backend(bpe)
        add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
        split = PRE_TOKENIZER_SPLITS[pre]
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        given = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                 "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}  # fmt: skip
        named = {k: v for k, v in given.items() if v is not None}
        # Control tokens (and the named ones) stay whole and are skipped on decode; a control token
        # spelled outside the byte alphabet is a llama.cpp mislabel that transformers skips too.
        special = list(named.values()) + [
            t for t, kind in zip(tokens, types) if kind == _CONTROL and set(t) <= alphabet
        ]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
        user = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        backend.post_processor = _template_processor(
            backend,
            named.get("bos_token") if meta.get("tokenizer.ggml.add_bos_token", False) else None,
            named.get("eos_token") if meta.get("tokenizer.ggml.add_eos_token", False) else None,
        )
        template = meta.get("tokenizer.chat_template")
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=[i for i in eos if i is not None] + _chat_end_ids(backend, template),
            chat_template=template,
            special_tokens=named,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """Wrap ``transformers.AutoTokenizer`` for a local HF model directory."""
        path = Path(path)
        files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if not path.is_dir() or not any((path / f).is_file() for f in files):
            found = sorted(p.name for p in path.iterdir())[:10] if path.is_dir() else "no such directory"
            raise TokenizerError(
                f"{str(path)!r} holds no tokenizer (looked for {', '.join(files)}; found: {found}); "
                f"pass an HF model directory, or build from a GGUF with Tokenizer.from_gguf(GGUFFile(path))"
            )
        from transformers import AutoTokenizer  # slow import (~4 s): only on this path

        hf = AutoTokenizer.from_pretrained(str(path))
        eos = [hf.eos_token_id]
        for name in ("generation_config.json", "config.json"):
            if (path / name).is_file():
                value = json.loads((path / name).read_text()).get("eos_token_id")
                eos += value if isinstance(value, list) else [value]
        template = hf.chat_template if isinstance(hf.chat_template, str) else None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizerError(f"{str(path)!r}: transformers gave a slow tokenizer; shardlm needs tokenizer.json")
        return cls(
            backend,
            bos_token_id=hf.bos_token_id,
            eos_token_ids=[i for i in eos if i is not None] + _chat_end_ids(backend, template),
            chat_template=template,
            special_tokens={k: str(v) for k, v in hf.special_tokens_map.items() if isinstance(v, str)},
            hf=hf,
        )

    # ---- text <-> ids -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=add_special_tokens))
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._hf is not None:
            return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
        """Yield text deltas as ids arrive; ``"".join`` of them equals ``decode(all ids)``."""
        dec = IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)
        for i in ids:
            if delta := dec.push(i):
                yield delta
        if tail := dec.flush():
            yield tail

    # ---- chat -----------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, **kwargs: Any) -> str:  # fmt: skip
        """Render a conversation to the prompt string (transformers' ``tokenize=False`` output).

        ``chat_template`` overrides the model's; extra ``kwargs`` become template variables.
        """
        template = chat_template or self.chat_template
        if not template:
            raise TokenizerError(
                "this tokenizer has no chat template; encode the prompt text directly, pass "
                "chat_template=..., or load an instruct model whose GGUF/tokenizer_config.json carries one"
            )
        variables = {**self.special_tokens, "tools": None, "documents": None, **kwargs}
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """A conversation's token ids, as transformers' ``apply_chat_template(..., tokenize=True)`` gives
        them: the template writes every special token it wants (its BOS among them), so the rendered
        text is encoded without adding special tokens again (vLLM's rule; encoding it as a plain
        prompt would double the BOS of a tokenizer that adds one, as Llama 3's does)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDecoder:
    """Streaming detokenizer: ``push`` ids, get text deltas that never split a UTF-8 character.

    Each step decodes a short window of ids (from ``prefix``, the start of the previously emitted
    piece, so decoders that look at neighbours -- byte-level merging, sentencepiece's leading space
    -- see context) and emits what the new ids added. Text ending in U+FFFD means the last token
    holds an unfinished multi-byte character: wait for more ids (``flush`` emits it as-is at the
    end, as the full decode would). The idea is vLLM's ``detokenize_incrementally``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window start: the first id of the last emitted piece
        self._read = 0  # ids before this are emitted

    def push(self, ids: int | Iterable[int]) -> str:
        self.ids.extend([ids] if isinstance(ids, int) else ids)
        prev, text = self._window()
        if len(text) > len(prev) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(prev) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a dangling partial character, rendered as U+FFFD)."""
        prev, text = self._window()
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(prev) :]

    def _window(self) -> tuple[str, str]:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prev = decode(self.ids[self._prefix : self._read], skip_special_tokens=skip)
        return prev, decode(self.ids[self._prefix :], skip_special_tokens=skip)


def _chat_end_ids(backend: Backend, template: str | None) -> list[int]:
    """Ids of known end-of-turn tokens that the chat template writes (e.g. ``<|im_end|>``)."""
    found = [backend.token_to_id(t) for t in _CHAT_END_TOKENS if template and t in template]
    return [i for i in found if i is not None]


def _template_processor(backend: Backend, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    # Same template strings as transformers' TokenizersBackend.update_post_processor.
    single = f"{bos + ':0 ' if bos else ''}$A:0{' ' + eos + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if bos else ''} $B:1{' ' + eos + ':1' if eos else ''}"
    special = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (https://github.com/openai/gpt-2, encoder.py)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    """A template compiled in a sandbox configured like transformers' ``_cached_compile_jinja_template``."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}`` marks assistant text; rendering keeps the body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares tags so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:  # fmt: skip
        # jinja's own tojson escapes HTML characters; transformers overrides it with plain json.dumps
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)

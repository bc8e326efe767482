"""OpenAI request schemas, and what a request becomes for the engine (``prepare``).

Types are strict (``"max_tokens": "16"`` is an error, as at OpenAI). Extensions (vLLM's
names): ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``stop_token_ids``,
``ignore_eos``, ``return_token_ids``. Every other field OpenAI or vLLM defines is in a
NOT_IMPLEMENTED table: refused with a 400 that names it unless absent or set to a value that
asks for nothing. Fields nobody defines are ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, cast

from pydantic import BaseModel, ConfigDict, create_model

from shardlm.engine.sampling import SamplingParams
from shardlm.engine.structured import StructuredOutputsParams, check_grammar
from shardlm.errors import UsageError
from shardlm.server.errors import bad_request

GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS); tinier ones overflow logits / T
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_LOGPROBS = 20  # most top logprobs a token may ask for (OpenAI's top_logprobs bound, vLLM's max_logprobs)
ROLES = {"system", "user", "assistant", "tool", "developer"}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None


class ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


# Request fields OpenAI or vLLM define that shardlm does not implement (yet), with the values that
# ask for nothing (accepted, as if absent); any other value is refused with a 400 that names the
# field. Fields in no table and no model are unknown here and ignored (docs/serve.md lists them).
NOT_IMPLEMENTED: dict[str, tuple] = {
    # OpenAI, both endpoints
    "service_tier": ("auto", "default"),
    "store": (False,),
    # vLLM's sampling and output options
    "use_beam_search": (False,),
    "length_penalty": (1,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": (),
    "return_tokens_as_token_ids": (False,),
    "priority": (0,),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    # vLLM's structured output options (the outputs themselves are served: STRUCTURED)
    "guided_decoding_backend": ("auto", "guidance", "llguidance"),
    "guided_whitespace_pattern": (),
    "structural_tag": (),
}
CHAT_NOT_IMPLEMENTED: dict[str, tuple] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True, False),  # nothing without tools
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "verbosity": (),
    "echo": (False,),
    "continue_final_message": (False,),
    "add_special_tokens": (False,),  # what the chat endpoint does (the template writes them)
    "documents": (),
    "mm_processor_kwargs": (),
}
COMPLETION_NOT_IMPLEMENTED: dict[str, tuple] = {
    "suffix": ("",),
    "add_special_tokens": (True,),  # what the completions endpoint does
}


def _declared(name: str, table: dict[str, tuple]) -> type[_Strict]:
    """A base model declaring ``table``'s fields (any JSON value; ``prepare`` checks them)."""
    fields: dict[str, Any] = dict.fromkeys(table, (Any, None))
    return create_model(name, __base__=_Strict, **fields)


class _Sampling(_declared("_NotImplemented", NOT_IMPLEMENTED)):  # type: ignore[misc]
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None
    return_token_ids: bool | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, not used


class ChatRequest(_Sampling, _declared("_ChatNotImplemented", CHAT_NOT_IMPLEMENTED)):  # type: ignore[misc]
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None


class CompletionRequest(_Sampling, _declared("_CompletionNotImplemented", COMPLETION_NOT_IMPLEMENTED)):  # type: ignore[misc]
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


def tokenize(req: TokenizeRequest, engine, served_model: str) -> dict:
    _check_model(req.model, served_model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt (text) or messages (a chat)", param="prompt")
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = engine.tokenizer.encode(req.prompt, add_special_tokens=special)
    else:
        ids = _chat_ids(req, engine.tokenizer, req.add_generation_prompt, bool(req.add_special_tokens))
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def detokenize(req: DetokenizeRequest, engine, served_model: str) -> dict:
    _check_model(req.model, served_model)
    _check_vocab(req.tokens, engine, "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def _check_model(model: str | None, served_model: str) -> None:
    if model is not None and model != served_model:
        raise bad_request(
            f"model {model!r} is not served here; this server serves {served_model!r} (see /v1/models)",
            param="model",
            code="model_not_found",
        )


def _check_vocab(ids: list[int], engine, param: str) -> None:
    vocab = engine.checkpoint.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"{param} token id {bad[0]} is outside the vocabulary [0, {vocab})", param=param)


@dataclass
class Prepared:
    """A validated request: what the engine runs and how the answer is shaped."""

    prompts: list[list[int]]  # one, or several (/v1/completions); each gets params.n choices
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: int | None  # top logprobs per token in the answer (None: no logprobs)
    prompt_logprobs: int | None = None  # vLLM's: top logprobs per prompt token, in their own field
    echo: list[str] | None = None  # completions: each prompt's text, which leads its choices (and its logprobs)
    drop_sampled: bool = False  # echo with max_tokens 0: the prompt only (the one token run is dropped)

    @property
    def choices(self) -> int:
        """Completions the engine generates (best_of of them per prompt with best_of)."""
        return len(self.prompts) * self.params.generated


def prepare(req: ChatRequest | CompletionRequest, engine, served_model: str) -> Prepared:
    """Check a request against the served model and turn it into prompt ids and sampling params."""
    _check_model(req.model, served_model)
    _refuse_unsupported(req)
    chat = isinstance(req, ChatRequest)
    if isinstance(req, ChatRequest):
        generation_prompt = req.add_generation_prompt is not False
        prompts, where = [_chat_ids(req, engine.tokenizer, generation_prompt)], "messages"
    else:
        prompts, where = _completion_ids(req, engine), "prompt"
    for i, ids in enumerate(prompts):
        at = where if len(prompts) == 1 else f"{where}[{i}]"
        if not ids:
            raise bad_request(f"the {at} encodes to no tokens; give at least one token", param=where)
        if len(ids) >= engine.max_model_len:
            raise bad_request(
                f"the {at} has {len(ids)} tokens but this model's context is {engine.max_model_len} tokens "
                f"(prompt + output); shorten it to at most {engine.max_model_len - 1}",
                param=where,
                code="context_length_exceeded",
            )
    longest = max(prompts, key=len)  # the one that bounds max_tokens
    at = where if len(prompts) == 1 else f"longest {where}"
    room, why = engine.room(len(longest))
    if room < 1:
        raise bad_request(
            f"the {at} has {len(longest)} tokens but {why} leaves no room for an answer; shorten it",
            param=where,
            code="context_length_exceeded",
        )
    name, max_tokens = ("max_tokens", req.max_tokens)
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    drop_sampled = echo and max_tokens == 0  # scoring a prompt (lm-eval's loglikelihood): no new token
    if drop_sampled:
        max_tokens = 1
    defaults = engine.sampling_defaults  # the model's generation_config.json (serve --generation-config)
    if max_tokens is None:
        max_tokens = min(defaults.get("max_tokens", room if chat else DEFAULT_COMPLETION_TOKENS), room)
    elif max_tokens < 1:
        raise bad_request(f"{name}={max_tokens} must be at least 1 (0 only with echo), e.g. 64", param=name)
    elif max_tokens > room:
        raise bad_request(
            f"{name}={max_tokens} does not fit: the {at} has {len(longest)} tokens and {why}, "
            f"so at most {room} new tokens fit; lower {name} to {room} or less",
            param=name,
            code="context_length_exceeded",
        )
    temperature = defaults.get("temperature", 1.0) if req.temperature is None else req.temperature
    if temperature < 0:
        raise bad_request(f"temperature={temperature} must be >= 0 (0 is greedy), e.g. 0.7", param="temperature")
    top_k = defaults.get("top_k", 0) if req.top_k is None else req.top_k
    top_k = 0 if top_k == -1 else top_k
    if req.seed is not None and not -(2**63) <= req.seed < 2**64:
        raise bad_request(
            f"seed={req.seed} is out of range; torch seeds are 64-bit: use an integer in [-2**63, 2**64), e.g. 42",
            param="seed",
        )
    logprobs = _logprobs(req)
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"prompt_logprobs={req.prompt_logprobs} must be in [0, {MAX_LOGPROBS}], e.g. 1", param="prompt_logprobs"
        )
    scored = [k for k in (req.prompt_logprobs, logprobs if echo else None) if k is not None]
    structured = _structured(req, engine)
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    if best_of is not None and best_of > (req.n or 1) and req.stream:
        raise bad_request(
            f"best_of={best_of} cannot be streamed (as at OpenAI); drop stream or best_of", param="best_of"
        )
    try:
        params = SamplingParams(
            n=1 if req.n is None else req.n,
            best_of=best_of,
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else temperature,
            top_p=defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=top_k,
            min_p=defaults.get("min_p", 0.0) if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=defaults.get("repetition_penalty", 1.0)
            if req.repetition_penalty is None
            else req.repetition_penalty,
            logit_bias=_logit_bias(req.logit_bias, engine),
            min_tokens=req.min_tokens or 0,
            seed=req.seed,
            ignore_eos=bool(req.ignore_eos),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            logprobs=logprobs,
            prompt_logprobs=max(scored) if scored else None,
            structured_outputs=structured,
        )
    except UsageError as e:  # its message names the value (top_p, top_k, ...)
        raise bad_request(str(e), param=re.split(r"[=\[ ]", str(e), maxsplit=1)[0]) from None
    if params.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens={params.min_tokens} is above {name}={max_tokens}; lower it or raise {name}",
            param="min_tokens",
        )
    if req.stop_token_ids:
        _check_vocab(req.stop_token_ids, engine, "stop_token_ids")
    options = req.stream_options
    return Prepared(
        prompts=prompts,
        params=params,
        stream=bool(req.stream),
        include_usage=bool(req.stream and options and options.include_usage),
        return_token_ids=bool(req.return_token_ids),
        logprobs=logprobs,
        prompt_logprobs=req.prompt_logprobs,
        echo=[p if isinstance(p, str) else engine.tokenizer.decode(p) for p in completion_prompts(req)]
        if isinstance(req, CompletionRequest) and echo
        else None,
        drop_sampled=drop_sampled,
    )


def _logprobs(req: ChatRequest | CompletionRequest) -> int | None:
    """Top logprobs per token, or None: chat's ``logprobs`` (bool) with ``top_logprobs``, or
    completions' ``logprobs`` (int)."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request(f"top_logprobs={req.top_logprobs} needs logprobs=true; set both", param="top_logprobs")
        k, name = (req.top_logprobs or 0, "top_logprobs") if req.logprobs else (None, "top_logprobs")
    else:
        k, name = req.logprobs, "logprobs"
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise bad_request(f"{name}={k} must be in [0, {MAX_LOGPROBS}], e.g. 5", param=name)
    return k


STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""The fields that ask for a structured answer (OpenAI's, then vLLM's): one per request."""


def _structured(req: ChatRequest | CompletionRequest, engine) -> StructuredOutputsParams | None:
    """OpenAI's ``response_format`` (json_object, json_schema) or vLLM's ``structured_outputs`` /
    ``guided_*`` fields as one spec, compiled and checked against the model's vocabulary."""
    given = [f for f in STRUCTURED if getattr(req, f) is not None and getattr(req, f) != {"type": "text"}]
    if not given:
        return None
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} both ask for a structured answer; give one", param=given[1])
    name, value = given[0], getattr(req, given[0])
    try:
        if name == "response_format":
            kind = value.get("type")
            if kind == "json_object":
                spec = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                schema = (value.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise UsageError(
                        'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
                    )
                spec = StructuredOutputsParams(json=schema)
            else:
                raise UsageError(f"response_format type {kind!r} is not one of text, json_object, json_schema")
        elif name == "structured_outputs":
            unknown = set(value) - {"json", "regex", "choice", "grammar", "json_object"}
            if unknown:
                raise UsageError(
                    f"structured_outputs has unknown keys {sorted(unknown)}; use json, regex, choice, grammar or json_object"
                )
            spec = StructuredOutputsParams(**value)
        else:
            spec = StructuredOutputsParams(**{name.removeprefix("guided_"): value})
        check_grammar(spec, engine.tokenizer, engine.checkpoint.config.vocab_size)
    except UsageError as e:
        raise bad_request(f"{name}: {e}", param=name) from None
    if engine.config.speculative_config is not None:
        raise bad_request(
            f"{name}: structured outputs do not run with speculative decoding on this server yet; leave it out",
            param=name,
        )
    return spec


def _logit_bias(bias: dict[str, float] | None, engine) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as JSON keys (strings), biases in [-100, 100]."""
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(
                f'logit_bias key {key!r} is not a token id; map token ids to biases, e.g. {{"50256": -100}}',
                param="logit_bias",
            ) from None
        out[token] = value
    _check_vocab(list(out), engine, "logit_bias")
    return out


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: 0 and 0.0 alike, but a boolean only equals a boolean (not 0 or 1)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def _refuse_unsupported(req) -> None:
    endpoint = CHAT_NOT_IMPLEMENTED if isinstance(req, ChatRequest) else COMPLETION_NOT_IMPLEMENTED
    for name, neutral in {**NOT_IMPLEMENTED, **endpoint}.items():
        value = getattr(req, name)
        if value is not None and not any(_same(value, n) for n in neutral):
            asks = "" if not neutral else f" (only {' or '.join(json.dumps(n) for n in neutral)} is accepted)"
            raise bad_request(
                f"{name}={json.dumps(value)[:80]} is not supported by shardlm yet{asks}; leave it out "
                "(the fields shardlm serves are listed in docs/serve.md)",
                param=name,
            )


def _chat_ids(
    req: ChatRequest | TokenizeRequest, tokenizer, add_generation_prompt: bool = True, add_special_tokens: bool = False
) -> list[int]:
    """The ids of ``req.messages`` through the chat template (HF's ``tokenize=True`` ids unless
    ``add_special_tokens`` asks the tokenizer to add its own on top, as vLLM's /tokenize may)."""
    if not req.messages:
        raise bad_request(
            'messages is empty; give at least one, e.g. [{"role": "user", "content": "Hello"}]', param="messages"
        )
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise bad_request(
                f"messages[{i}].role={m.role!r} is not a role; use one of {', '.join(sorted(ROLES))}",
                param=f"messages[{i}].role",
            )
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{i}].content[{j}] is of type {part.type!r}; this model reads text "
                        f'only: {{"type": "text", "text": ...}}',
                        param=f"messages[{i}].content",
                    )
            content = "".join(p.text or "" for p in content)  # each checked above
        message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    template: dict[str, Any] = {}  # vLLM's per-request chat_template and its variables (chat requests)
    if isinstance(req, ChatRequest):
        template = dict(req.chat_template_kwargs or {})
        if req.chat_template:
            template["chat_template"] = req.chat_template
    if not (template.get("chat_template") or tokenizer.chat_template):
        raise bad_request(
            "this model has no chat template; use /v1/completions with a raw prompt, or give chat_template",
            param="messages",
        )
    try:
        if add_special_tokens:
            return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt, **template))
        return tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, **template)
    except Exception as e:
        where = "chat_template" if "chat_template" in template else "messages"
        raise bad_request(f"the chat template refused these messages: {e}", param=where) from None


def completion_prompts(req: CompletionRequest) -> list:
    """The request's prompts: one text or list of ids, or several of either (a batch)."""
    prompt = req.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _completion_ids(req: CompletionRequest, engine) -> list[list[int]]:
    out = []
    for p in completion_prompts(req):
        if isinstance(p, str):
            out.append(engine.tokenizer.encode(p))
        else:
            ids = cast("list[int]", p)  # a list of token ids (strict types: ints only)
            _check_vocab(ids, engine, "prompt")
            out.append(list(ids))
    return out

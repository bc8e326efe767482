"""The server's pure parts, without ranks: stop strings, request checks, error bodies."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from shardlm.engine.async_llm import AsyncLLM
from shardlm.engine.text import StopText
from shardlm.server.errors import APIError, from_validation
from shardlm.server.protocol import ChatRequest, CompletionRequest, prepare


@pytest.fixture(scope="module")
def tok():
    from shardlm.models.loader import open_checkpoint

    return open_checkpoint("smollm2").tokenizer()


def streamed(tok, text: str, stops: tuple[str, ...]) -> tuple[list[str], bool]:
    st = StopText(tok, stops)
    out = []
    for i in tok.encode(text):
        out.append(st.push([i]))
        if st.stopped:
            return out, True
    return out + [st.flush()], st.stopped


@pytest.mark.parametrize(
    "stops, expected",
    [
        ((), "Paris is the capital. It is big."),
        (("capital",), "Paris is the "),
        ((". It",), "Paris is the capital"),  # the stop spans tokens
        (("zzz", "is"), "Par"),  # the earliest of several, inside a word too (as OpenAI)
        (("big.",), "Paris is the capital. It is "),
        (("",), "Paris is the capital. It is big."),  # an empty stop string is ignored
    ],
)
def test_stop_strings_cut_the_text_and_streaming_agrees(tok, stops, expected):
    deltas, stopped = streamed(tok, "Paris is the capital. It is big.", stops)
    assert "".join(deltas) == expected
    assert bool(stopped) == (expected != "Paris is the capital. It is big.")


def test_text_that_may_start_a_stop_string_is_held_back(tok):
    st = StopText(tok, ("capital city",))
    got = "".join(st.push([i]) for i in tok.encode("Paris is the capital"))
    assert got == "Paris is "  # "the capital" (11 chars) could still become the stop string
    assert st.flush() == "the capital" and not st.stopped


@pytest.fixture
def engine(tok):
    fake = SimpleNamespace(
        tokenizer=tok,
        max_model_len=64,
        kv_blocks=100,
        kv_tokens=1600,
        config=SimpleNamespace(block_size=16, speculative_config=None),
        sampling_defaults={},
        checkpoint=SimpleNamespace(config=SimpleNamespace(vocab_size=49152)),
    )
    fake.room = lambda prompt_len: AsyncLLM.room(fake, prompt_len)  # the engine's own rule
    return fake


def chat(**kw) -> ChatRequest:
    return ChatRequest(messages=[{"role": "user", "content": "Hi"}], **kw)


def refused(engine, req) -> APIError:
    with pytest.raises(APIError) as e:
        prepare(req, engine, "smollm2")
    assert e.value.status == 400
    return e.value


def test_defaults_follow_openai(engine, tok):
    p = prepare(chat(), engine, "smollm2")
    assert p.params.temperature == 1.0 and p.params.top_p == 1.0 and p.params.top_k == 0
    assert p.params.max_tokens == 64 - len(p.prompts[0])  # chat: up to the end of the context
    assert p.prompts == [tok.encode_chat([{"role": "user", "content": "Hi"}])]
    c = prepare(CompletionRequest(prompt="Hi"), engine, "smollm2")
    assert c.params.max_tokens == 16 and c.prompts == [tok.encode("Hi")]  # completions: OpenAI's 16
    assert not c.stream and not c.include_usage and c.logprobs is None and c.params.n == 1
    several = prepare(CompletionRequest(prompt=["Hi", "Hello there"], n=2), engine, "smollm2")
    assert several.prompts == [tok.encode("Hi"), tok.encode("Hello there")] and several.choices == 4


def test_parameters_reach_sampling(engine):
    p = prepare(
        chat(
            max_completion_tokens=5,
            max_tokens=9,
            temperature=0.5,
            top_p=0.9,
            top_k=-1,
            seed=3,
            stop="x",
            stop_token_ids=[7],
            stream=True,
            stream_options={"include_usage": True},
            n=3,
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            repetition_penalty=1.1,
            min_p=0.05,
            min_tokens=2,
            logit_bias={"17": -100, "5": 2.5},
            logprobs=True,
            top_logprobs=4,
        ),
        engine,
        "smollm2",
    )
    q = p.params
    got = (q.max_tokens, q.temperature, q.top_p, q.top_k, q.seed, q.n)
    assert got == (5, 0.5, 0.9, 0, 3, 3)  # max_completion_tokens wins over max_tokens; top_k -1 is off
    assert q.stop_token_ids == (7,) and q.stop == ("x",) and p.stream and p.include_usage
    assert (q.presence_penalty, q.frequency_penalty, q.repetition_penalty, q.min_p) == (0.5, -0.25, 1.1, 0.05)
    assert q.min_tokens == 2 and q.logit_bias == {17: -100, 5: 2.5} and q.logprobs == p.logprobs == 4
    assert prepare(chat(logprobs=True), engine, "smollm2").logprobs == 0  # the chosen token's only
    assert prepare(CompletionRequest(prompt="Hi", logprobs=2), engine, "smollm2").params.logprobs == 2
    assert prepare(chat(temperature=1e-40), engine, "smollm2").params.greedy  # 1/T would overflow the logits
    parts = ChatRequest(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}]}
        ]
    )
    assert (
        prepare(parts, engine, "smollm2").prompts
        == prepare(ChatRequest(messages=[{"role": "system", "content": "Be brief"}]), engine, "smollm2").prompts
    )


@pytest.mark.parametrize(
    "req, param, words",
    [
        (lambda: chat(model="gpt-4"), "model", "'gpt-4' is not served here"),
        (lambda: chat(n=0), "n", "n=0 must be a positive integer"),
        (lambda: chat(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
        (lambda: chat(repetition_penalty=0), "repetition_penalty", "must be > 0"),
        (lambda: chat(min_p=2), "min_p", "[0, 1]"),
        (lambda: chat(min_tokens=9, max_tokens=5), "min_tokens", "above max_tokens=5"),
        (lambda: chat(logit_bias={"x": 1}), "logit_bias", "not a token id"),
        (lambda: chat(logit_bias={"99999": 1}), "logit_bias", "outside the vocabulary"),
        (lambda: chat(logit_bias={"5": 200}), "logit_bias", "[-100, 100]"),
        (lambda: chat(top_logprobs=3), "top_logprobs", "needs logprobs=true"),
        (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
        (lambda: CompletionRequest(prompt="Hi", logprobs=-1), "logprobs", "[0, 20]"),
        (lambda: chat(stop_token_ids=[99999]), "stop_token_ids", "outside the vocabulary"),
        (lambda: CompletionRequest(prompt="Hi", n=3, best_of=2), "best_of", "must be an integer >= n=3"),
        (lambda: CompletionRequest(prompt="Hi", best_of=2, stream=True), "best_of", "cannot be streamed"),
        (lambda: chat(max_tokens=0), "max_tokens", "at least 1"),
        (lambda: chat(max_tokens=60), "max_tokens", "lower max_tokens to"),
        (lambda: chat(temperature=-0.1), "temperature", ">= 0"),
        (lambda: chat(top_p=1.5), "top_p", "top_p=1.5"),
        (lambda: chat(top_k=-2), "top_k", "top_k=-2"),
        (lambda: chat(seed=2**70), "seed", "out of range"),
        (lambda: ChatRequest(messages=[]), "messages", "messages is empty"),
        (
            lambda: ChatRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "messages[0].content",
            "text only",
        ),
        (lambda: CompletionRequest(prompt="word " * 70), "prompt", "shorten it"),
        (lambda: CompletionRequest(prompt=[-1]), "prompt", "outside the vocabulary"),
        (lambda: CompletionRequest(prompt=["a", ""]), "prompt", "prompt[1] encodes to no tokens"),
        (lambda: CompletionRequest(prompt=""), "prompt", "no tokens"),
        (lambda: chat(echo=True), "echo", "not supported"),
        (lambda: CompletionRequest(prompt="Hi", max_tokens=0), "max_tokens", "0 only with echo"),
        (lambda: chat(prompt_logprobs=21), "prompt_logprobs", "[0, 20]"),
    ],
)
def test_refusals_name_the_field(engine, req, param, words):
    e = refused(engine, req())
    assert e.param == param and words in e.message, e.message


def test_max_tokens_is_bounded_by_the_kv_cache_too(engine):
    engine.kv_tokens = 32  # 2 blocks of 16: a request may use at most 33 tokens
    p = prepare(chat(), engine, "smollm2")
    assert len(p.prompts[0]) + p.params.max_tokens - 1 == 32
    assert "the KV cache 32 tokens" in refused(engine, chat(max_tokens=30)).message
    e = refused(engine, CompletionRequest(prompt="word " * 40))  # fits the context (64), not the cache
    assert e.param == "prompt" and "leaves no room" in e.message


@pytest.mark.parametrize(
    "body, param, words",
    [
        (b'{"messages": [', None, "not valid JSON"),
        (b'"hello"', None, "must be a JSON object"),
        (b'{"messages": [{"role": "user"}], "temperature": true}', "temperature", "must be a finite number, not true"),
        (b'{"messages": [{"content": "Hi"}]}', "messages[0].role", "is required"),
        (b'{"messages": [], "stop": [1]}', "stop", "a string or an array of strings"),
        (b'{"messages": [], "max_tokens": 1.5}', "max_tokens", "must be an integer, not 1.5"),
    ],
)
def test_validation_errors_become_openai_400s(body, param, words):
    with pytest.raises(ValidationError) as e:
        ChatRequest.model_validate_json(body)
    err = from_validation(e.value, ChatRequest)
    assert err.status == 400 and err.param == param and words in err.message, err.message
    assert err.body()["error"]["type"] == "invalid_request_error"


def test_the_engine_guards_the_same_bounds_for_python_callers(engine):
    """AsyncLLM.check (used by every caller, not only the server) applies the rule prepare() uses."""
    from shardlm import SamplingParams
    from shardlm.errors import UsageError

    engine.kv_tokens = 32  # 2 blocks of 16: at most 33 tokens per request
    AsyncLLM.check(engine, [1] * 30, SamplingParams(temperature=0.0, max_tokens=3))
    with pytest.raises(UsageError, match=r"max_tokens=4 does not fit.*the KV cache 32 tokens.*to 3 or less"):
        AsyncLLM.check(engine, [1] * 30, SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(UsageError, match="leaves no room"):
        AsyncLLM.check(engine, [1] * 33, SamplingParams(temperature=0.0, max_tokens=1))
    with pytest.raises(UsageError, match="empty"):
        AsyncLLM.check(engine, [], SamplingParams(temperature=0.0, max_tokens=1))


# ---- every field OpenAI or vLLM defines is honoured or refused -------------------------------

IMPLEMENTED = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "seed", "stream",
    "stream_options", "ignore_eos", "return_token_ids", "user", "messages", "max_completion_tokens", "prompt",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "logprobs",
    "top_logprobs", "prompt_logprobs", "echo", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "best_of", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
}  # fmt: skip
"""The request fields prepare() honours (user: accepted, documented as not used)."""


def both_requests(**kw):
    return [("chat", chat(**kw)), ("completions", CompletionRequest(prompt="Hi", **kw))]


def test_every_declared_field_is_implemented_or_in_a_refusal_table():
    from shardlm.server.protocol import CHAT_NOT_IMPLEMENTED, COMPLETION_NOT_IMPLEMENTED, NOT_IMPLEMENTED

    assert set(ChatRequest.model_fields) == IMPLEMENTED - {"prompt", "best_of"} | set(NOT_IMPLEMENTED) | set(
        CHAT_NOT_IMPLEMENTED
    )
    assert set(CompletionRequest.model_fields) == (
        IMPLEMENTED
        - {"messages", "max_completion_tokens", "top_logprobs", "chat_template", "chat_template_kwargs"}
        - {"add_generation_prompt"}
        | set(NOT_IMPLEMENTED)
        | set(COMPLETION_NOT_IMPLEMENTED)
    )


def not_implemented_cases():
    from shardlm.server.protocol import CHAT_NOT_IMPLEMENTED, COMPLETION_NOT_IMPLEMENTED, NOT_IMPLEMENTED

    for endpoint, table in (("chat", CHAT_NOT_IMPLEMENTED), ("completions", COMPLETION_NOT_IMPLEMENTED)):
        for name, neutral in {**NOT_IMPLEMENTED, **table}.items():
            yield endpoint, name, neutral


@pytest.mark.parametrize("endpoint, name, neutral", list(not_implemented_cases()), ids=lambda x: str(x)[:20])
def test_unimplemented_fields_are_refused_by_name_unless_neutral(engine, endpoint, name, neutral):
    make = (lambda **kw: chat(**kw)) if endpoint == "chat" else (lambda **kw: CompletionRequest(prompt="Hi", **kw))
    e = refused(engine, make(**{name: "on"}))  # a value that asks for something
    assert e.param == name and f"{name}=" in e.message and "not supported" in e.message
    for value in (None, *neutral):  # absent, or asking for nothing: accepted as if absent
        assert prepare(make(**{name: value}), engine, "smollm2").prompts[0]


@pytest.mark.parametrize(
    "field, value, neutral",
    [
        ("structural_tag", {"type": "structural_tag"}, None),
    ],
)
def test_the_fields_clients_send_most_are_refused_not_ignored(engine, field, value, neutral):
    for _, req in both_requests(**{field: value}):
        assert refused(engine, req).param == field
    for _, req in both_requests(**{field: neutral}):
        prepare(req, engine, "smollm2")
    with pytest.raises(ValidationError):  # chat's logprobs is a boolean: 1 is not true
        chat(logprobs=1)


# ---- vLLM's /tokenize and /detokenize --------------------------------------------------------


def test_tokenize_a_prompt_or_a_chat_as_hf_and_back(engine, tok):
    from shardlm.server.protocol import DetokenizeRequest, TokenizeRequest, detokenize, tokenize

    got = tokenize(TokenizeRequest(prompt="Hello world"), engine, "smollm2")
    assert got == {"count": len(tok.encode("Hello world")), "max_model_len": 64, "tokens": tok.encode("Hello world")}
    chat_ids = tokenize(TokenizeRequest(messages=[{"role": "user", "content": "Hi"}]), engine, "smollm2")["tokens"]
    assert chat_ids == tok.encode_chat([{"role": "user", "content": "Hi"}])  # the ids /v1/chat/completions runs
    no_prompt = TokenizeRequest(messages=[{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert len(tokenize(no_prompt, engine, "smollm2")["tokens"]) < len(chat_ids)
    back = detokenize(DetokenizeRequest(tokens=chat_ids), engine, "smollm2")["prompt"]
    assert back == tok.apply_chat_template([{"role": "user", "content": "Hi"}])  # special tokens kept
    for req, param in (
        (lambda: tokenize(TokenizeRequest(), engine, "smollm2"), "prompt"),
        (lambda: tokenize(TokenizeRequest(prompt="a", messages=[]), engine, "smollm2"), "prompt"),
        (lambda: tokenize(TokenizeRequest(prompt="a", model="gpt-4"), engine, "smollm2"), "model"),
        (lambda: detokenize(DetokenizeRequest(tokens=[10**9]), engine, "smollm2"), "tokens"),
    ):
        with pytest.raises(APIError) as e:
            req()
        assert e.value.status == 400 and e.value.param == param


def test_api_key_guards_v1_only():
    """serve --api-key: /v1 requests need 'Authorization: Bearer KEY' (a 401 in OpenAI's error shape
    otherwise); /health, /metrics, /version, /tokenize stay open, as in vLLM."""
    import asyncio
    import json

    from shardlm.server.app import RequireKey

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    def call(path: str, headers: list) -> tuple[int, bytes]:
        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "path": path, "headers": headers, "method": "GET"}
        asyncio.run(RequireKey(inner, "sekret")(scope, None, send))
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    good, bad = [(b"authorization", b"Bearer sekret")], [(b"authorization", b"Bearer other")]
    assert call("/v1/models", good)[0] == 200
    for headers in ([], bad):
        status, body = call("/v1/chat/completions", headers)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert call("/health", [])[0] == call("/tokenize", [])[0] == 200


# ---- structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* -------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(
    "fields, want",
    [
        (dict(response_format={"type": "json_object"}), dict(json_object=True)),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
            dict(json=SCHEMA),
        ),
        (dict(structured_outputs={"regex": "[0-9]+"}), dict(regex="[0-9]+")),
        (dict(structured_outputs={"choice": ["yes", "no"]}), dict(choice=("yes", "no"))),
        (dict(guided_json=SCHEMA), dict(json=SCHEMA)),
        (dict(guided_json='{"type": "object"}'), dict(json={"type": "object"})),
        (dict(guided_regex="a+b"), dict(regex="a+b")),
        (dict(guided_choice=["x", "y"]), dict(choice=("x", "y"))),
        (dict(guided_grammar='start: "hi" | "ho"'), dict(grammar='start: "hi" | "ho"')),
        (dict(response_format={"type": "text"}), None),
    ],
)
def test_structured_fields_reach_sampling(engine, fields, want):
    from shardlm import StructuredOutputsParams

    for _, req in both_requests(**fields):
        got = prepare(req, engine, "smollm2").params.structured_outputs
        assert got == (None if want is None else StructuredOutputsParams(**want))


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (dict(response_format={"type": "xml"}), "response_format", "not one of text, json_object, json_schema"),
        (dict(response_format={"type": "json_schema"}), "response_format", "needs"),
        (dict(guided_regex="[a-"), "guided_regex", "unclosed character class"),
        (dict(guided_json={"type": "nonsense"}), "guided_json", "refused"),
        (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
        (dict(guided_choice=[]), "guided_choice", "non-empty list"),
        (dict(structured_outputs={"yaml": "x"}), "structured_outputs", "unknown keys"),
        (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
        (dict(guided_regex="a", guided_choice=["b"]), "guided_choice", "give one"),
        (dict(guided_decoding_backend="xgrammar", guided_regex="a"), "guided_decoding_backend", "not supported"),
    ],
)
def test_structured_refusals_name_the_field(engine, fields, param, words):
    e = refused(engine, chat(**fields))
    assert e.param == param and words in e.message, e.message


def test_echo_and_prompt_logprobs_reach_sampling(engine, tok):
    p = prepare(CompletionRequest(prompt=["Hi", "Yo"], echo=True, logprobs=2, max_tokens=0), engine, "smollm2")
    assert p.echo == ["Hi", "Yo"] and p.drop_sampled and p.params.max_tokens == 1  # scores the prompt only
    assert p.params.prompt_logprobs == 2 and p.prompt_logprobs is None  # for the echo, not vLLM's own field
    q = prepare(CompletionRequest(prompt=tok.encode("Hi"), prompt_logprobs=3, logprobs=1), engine, "smollm2")
    assert q.echo is None and q.params.prompt_logprobs == q.prompt_logprobs == 3 and not q.drop_sampled
    assert prepare(chat(prompt_logprobs=0), engine, "smollm2").params.prompt_logprobs == 0


def test_structured_outputs_are_refused_with_speculation(engine):
    engine.config.speculative_config = {"method": "ngram"}
    assert "speculative" in refused(engine, chat(guided_regex="a+")).message


# ---- metrics under vLLM's names, and the request log line ------------------------------------


def test_metrics_are_also_exported_under_vllms_names():
    from shardlm.server.metrics import VLLM_NAMES, Metrics

    stats = dict.fromkeys(
        ("waiting", "running", "kv_blocks_used", "prefix_cache_hits", "prefix_cache_queries", "spec_draft_tokens",
         "spec_accepted_tokens", "kv_handoffs", "kv_transfer_bytes", "handoffs_recomputed", "num_preemptions"), 0
    )  # fmt: skip
    stats.update(running=3, kv_blocks_used=5, kv_blocks_total=20, num_preemptions=2)
    engine = SimpleNamespace(stats=stats, max_queue=8, healthy=True)
    m = Metrics(engine, "tiny")
    m.observe(arrival=0.0, first=0.5, last=1.5, tokens=3, reason="stop", queue=0.25)
    m.prompt_tokens.inc(7)
    text = m.render().decode()
    got = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] not in "#"}
    assert got['vllm:num_requests_running{model_name="tiny"}'] == 3
    assert got['vllm:kv_cache_usage_perc{model_name="tiny"}'] == 0.25
    assert got['vllm:num_preemptions_total{model_name="tiny"}'] == 2
    assert got['vllm:prompt_tokens_total{model_name="tiny"}'] == 7
    assert got['vllm:request_success_total{finished_reason="stop",model_name="tiny"}'] == 1
    assert got['vllm:time_to_first_token_seconds_count{model_name="tiny"}'] == 1
    assert got['vllm:request_queue_time_seconds_sum{model_name="tiny"}'] == 0.25
    assert got["shardlm_request_queue_time_seconds_sum"] == 0.25  # shardlm's own names stay
    exported = {name.split("{")[0] for name in got}
    for ours, theirs in VLLM_NAMES.items():  # every alias has a source: none is dead
        assert any(n.startswith(ours) for n in exported), ours
        assert any(n.startswith(theirs) for n in exported), theirs


def test_generation_config_defaults_fill_absent_fields(engine):
    engine.sampling_defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7}
    p = prepare(chat(), engine, "smollm2").params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 20, 7)
    q = prepare(chat(temperature=0, top_p=1.0, top_k=-1, max_tokens=3), engine, "smollm2").params
    assert (q.temperature, q.top_p, q.top_k, q.max_tokens) == (0, 1.0, 0, 3)  # the request's own win


def test_chat_template_fields_reach_the_template(engine, tok):
    plain = prepare(chat(chat_template="{{ messages[0]['content'] }}!"), engine, "smollm2").prompts[0]
    assert plain == tok.encode("Hi!", add_special_tokens=False)
    custom = "{{ greeting }} {{ messages[0]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    got = prepare(chat(chat_template=custom, chat_template_kwargs={"greeting": "Yo"}), engine, "smollm2").prompts[0]
    assert got == tok.encode("Yo Hi>", add_special_tokens=False)
    bare = prepare(chat(chat_template=custom, add_generation_prompt=False, chat_template_kwargs={"greeting": "Yo"}),
                   engine, "smollm2").prompts[0]  # fmt: skip
    assert bare == tok.encode("Yo Hi", add_special_tokens=False)
    e = refused(engine, chat(chat_template="{% if %}"))
    assert e.param == "chat_template" and "refused" in e.message

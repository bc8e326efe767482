"""`shardlm serve` end to end: a real server process on 127.0.0.1, the official `openai` client.

Greedy answers are checked token for token against offline ``LLM.generate`` on the same
prompts (same layout, tp=1); the last test stops the server with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import urllib.request
import uuid
from types import SimpleNamespace

import openai
import pytest

import shardlm
from harness.server_harness import ServerProcess, alive, get, metrics, wait_for
from shardlm import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about GPUs.",
    "Why is the sky blue?",
    "List three uses of a hash map.",
    "What does a compiler do?",
    "Who was Ada Lovelace?",
]
MAX_TOKENS = 8
CONTEXT = 1024  # --max-model-len: small, so over-long prompts are cheap to build
RAW = "The capital of France is"
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={"11": -100})
THREADS = 1  # on a shared 2-core machine two OpenMP threads per rank run ~10x slower than one (docs/serve.md)


@pytest.fixture(scope="module")
def reference():
    """Offline greedy answers: {question or RAW: (token ids, text, finish reason)} (RAW: 16 tokens, no EOS),
    and {question: chat prompt ids}."""
    with LLM("smollm2", kv_cache_memory=256 << 20, max_model_len=CONTEXT, threads=THREADS) as llm:
        outs = llm.chat(
            [[{"role": "user", "content": q}] for q in QUESTIONS],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        )
        raw = llm.generate(RAW, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
        first = [o.outputs[0] for o in outs]  # vLLM's shape of the same answers
        assert [(c.index, c.text, c.token_ids) for c in first] == [(0, o.text, o.token_ids) for o in outs]
        ref = {q: (o.token_ids, o.text, o.finish_reason) for q, o in zip(QUESTIONS, outs)}
        ref[RAW] = (raw.token_ids, raw.text, raw.finish_reason)
        ref["chat_ids"] = {q: llm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS}
        ref["logprobs"] = llm.chat(
            chat(QUESTIONS[0]), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
        )[0].outputs[0]
        ref["penalized"] = llm.generate(
            RAW, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, **PENALTIES)
        )[0].text
        ref["scored"] = llm.generate(RAW, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2))[0]
        return ref


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        "--kv-cache-memory", "256MiB", "--max-model-len", str(CONTEXT), "--max-queue", "64", "--threads", str(THREADS)
    )
    yield s
    s.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def extra(choice, name):
    return (choice.model_extra or {}).get(name)


def test_vllm_tokenize_detokenize_and_version(server, reference):
    ids = reference["chat_ids"][QUESTIONS[0]]
    status, got = post(server, "/tokenize", {"model": "smollm2", "messages": chat(QUESTIONS[0])})
    assert status == 200 and got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == CONTEXT
    status, text = post(server, "/detokenize", {"tokens": ids})
    assert (
        status == 200
        and post(server, "/tokenize", {"prompt": text["prompt"], "add_special_tokens": False})[1]["tokens"] == ids
    )  # the rendered chat, back to the same ids
    with urllib.request.urlopen(f"{server.root}/version", timeout=30) as r:
        assert json.loads(r.read())["version"] == shardlm.__version__
    status, err = post(server, "/tokenize", {"prompt": "a", "messages": chat("b")})
    assert status == 400 and err["error"]["param"] == "prompt"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    assert get(f"{server.root}/health")[0] == 200
    assert "KV cache: 364 blocks of 16 tokens = 5824 tokens" in server.log  # 256 MiB / 720 KiB per block


def test_chat_matches_offline_greedy(client, reference):
    q = QUESTIONS[0]
    ids, text, reason = reference[q]
    r = client.chat.completions.create(
        model="smollm2", messages=chat(q), max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert extra(choice, "token_ids") == ids and extra(choice, "prompt_token_ids") == reference["chat_ids"][q]
    assert choice.finish_reason == reason
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "smollm2"
    assert r.usage.prompt_tokens == len(reference["chat_ids"][q])
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(ids)


def test_chat_streams_openai_chunks(client, reference):
    q = QUESTIONS[1]
    stream = client.chat.completions.create(
        model="smollm2",
        messages=chat(q),
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reference[q][1]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [reference[q][2]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(reference[q][0])
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completion_streamed_and_not(client, reference):
    ids, text, _ = reference[RAW]
    r = client.completions.create(
        model="smollm2",
        prompt=RAW,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert r.object == "text_completion" and r.choices[0].text == text and extra(r.choices[0], "token_ids") == ids
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    chunks = list(
        client.completions.create(
            model="smollm2", prompt=RAW, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    by_ids = client.completions.create(
        model="smollm2", prompt=reference["chat_ids"][QUESTIONS[0]], max_tokens=MAX_TOKENS, temperature=0
    )  # a prompt given as token ids
    assert by_ids.choices[0].text == reference[QUESTIONS[0]][1]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_are_cut_like_openai(client, reference, stream):
    _ids, text, _ = reference[RAW]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    expected = text[: text.find(stop)]
    r = client.completions.create(
        model="smollm2",
        prompt=RAW,
        max_tokens=16,
        temperature=0,
        stream=stream,
        stop=["never-seen-stop", stop],
        extra_body={"ignore_eos": True},
    )
    chunks = list(r) if stream else [r]
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_match_offline_in_openai_shapes(client, reference):
    want = reference["logprobs"]
    r = client.chat.completions.create(
        model="smollm2",
        messages=chat(QUESTIONS[0]),
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for got, token, entry in zip(content, want.token_ids, want.logprobs, strict=True):
        assert got.logprob == pytest.approx(entry[token].logprob, abs=1e-3)
        assert got.bytes == list(got.token.encode())
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            sorted((e.logprob for e in entry.values()), reverse=True)[:3], abs=1e-3
        )
    streamed = client.completions.create(
        model="smollm2",
        prompt=RAW,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [c.choices[0] for c in streamed]
    tokens = [t for c in chunks for t in c.logprobs.tokens]
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert len(tokens) == 6 and "".join(tokens) == "".join(c.text for c in chunks)
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]  # where each token starts in the text
    assert all(len(c.logprobs.top_logprobs[0]) == 2 for c in chunks)


def test_echo_scores_the_prompt_as_offline(client, reference, tok):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    want = reference["scored"]
    ids = want.prompt_token_ids
    r = client.completions.create(model="smollm2", prompt=RAW, max_tokens=0, echo=True, logprobs=2)
    choice = r.choices[0]
    assert choice.text == RAW and r.usage.completion_tokens == 0 and choice.finish_reason == "length"
    assert choice.logprobs.tokens == [tok.decode([t]) for t in ids]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    for got, token, entry in zip(choice.logprobs.token_logprobs[1:], ids[1:], want.prompt_logprobs[1:], strict=True):
        assert got == pytest.approx(entry[token].logprob, abs=1e-3)
    streamed = list(
        client.completions.create(model="smollm2", prompt=RAW, max_tokens=2, echo=True, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == RAW + tok.decode(reference[RAW][0][:2])
    status, body = post(server_of(client), "/v1/completions", {"prompt": RAW, "max_tokens": 1, "prompt_logprobs": 1})
    scored = body["choices"][0]["prompt_logprobs"]
    assert status == 200 and scored[0] is None and len(scored) == len(ids)
    assert scored[1][str(ids[1])]["logprob"] == pytest.approx(want.prompt_logprobs[1][ids[1]].logprob, abs=1e-3)


def server_of(client) -> SimpleNamespace:
    return SimpleNamespace(root=str(client.base_url).rstrip("/").removesuffix("/v1"))


@pytest.mark.slow  # ~9 s
def test_n_choices_and_several_prompts(client, reference, tok):
    other = "Once upon a time"
    body = dict(model="smollm2", max_tokens=8, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=[RAW, other], n=2, **body)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts[0] != texts[1] and texts[2] != texts[3]  # each choice its own seed stream
    assert [c.text for c in client.completions.create(prompt=[RAW, other], n=2, **body).choices] == texts
    assert r.usage.completion_tokens == 4 * 8 and r.usage.prompt_tokens == len(tok.encode(RAW) + tok.encode(other))
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=RAW, n=2, stream=True, **body):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {0: texts[0], 1: texts[1]}
    greedy = client.chat.completions.create(
        model="smollm2", messages=chat(QUESTIONS[0]), max_tokens=MAX_TOKENS, n=3, temperature=0
    )
    assert [c.message.content for c in greedy.choices] == [reference[QUESTIONS[0]][1]] * 3


def test_best_of_returns_the_most_likely_of_its_samples(client):
    body = dict(model="smollm2", prompt=RAW, max_tokens=6, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    every = client.completions.create(n=4, logprobs=0, **body).choices
    best = client.completions.create(n=2, best_of=4, **body)
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]
    assert best.choices[0].logprobs is None and best.usage.completion_tokens == 4 * 6  # every sample is billed


def test_penalties_and_logit_bias_match_offline(client, reference):
    r = client.completions.create(
        model="smollm2", prompt=RAW, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, **PENALTIES}
    )
    assert r.choices[0].text == reference["penalized"] != reference[RAW][1]


@pytest.mark.slow
def test_structured_outputs_through_the_openai_client(client):
    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smollm2",
        messages=chat("Name a big city and its population, as JSON."),
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    picked = client.completions.create(
        model="smollm2", prompt="Is water wet? Answer:", max_tokens=4, extra_body={"guided_choice": [" yes", " no"]}
    )
    assert picked.choices[0].text in (" yes", " no")
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model="smollm2", prompt="Hi", extra_body={"guided_regex": "[a-"})


@pytest.fixture(scope="module")
def tok():
    from shardlm.models.loader import open_checkpoint

    return open_checkpoint("smollm2").tokenizer()


def test_stop_token_ids_end_without_their_text(client, reference, tok):
    ids, _, _ = reference[RAW]
    r = client.completions.create(
        model="smollm2",
        prompt=RAW,
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[3]], "return_token_ids": True},
    )
    first = ids.index(ids[3])
    assert extra(r.choices[0], "token_ids") == ids[: first + 1] and r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == tok.decode(ids[:first])


@pytest.mark.slow  # ~10 s
def test_seed_top_k_and_temperature(client, reference, tok):
    def sample(top_k: int | None = None, **kw) -> str:
        body = {"ignore_eos": True, **({"top_k": top_k} if top_k is not None else {})}
        return (
            client.completions.create(model="smollm2", prompt=RAW, max_tokens=8, extra_body=body, **kw).choices[0].text
        )

    greedy = tok.decode(reference[RAW][0][:8])
    assert sample(temperature=0) == greedy
    assert sample(temperature=1.0, seed=7) == sample(temperature=1.0, seed=7)
    assert sample(temperature=1.0, seed=3, top_k=1) == greedy  # top_k reaches the sampler
    assert len({sample(temperature=1.5, seed=s) for s in range(4)}) > 1  # and sampling does sample


def test_vllm_metric_names_and_one_log_line_per_request(server, client):
    before = metrics(server.root)
    r = client.completions.create(model="smollm2", prompt=RAW, max_tokens=2, temperature=0)
    after = metrics(server.root)
    key = 'vllm:generation_tokens_total{model_name="smollm2"}'
    assert after[key] - before.get(key, 0) == 2
    assert 0 <= after['vllm:kv_cache_usage_perc{model_name="smollm2"}'] <= 1
    assert after['vllm:request_queue_time_seconds_count{model_name="smollm2"}'] >= 1
    assert 'vllm:num_requests_waiting{model_name="smollm2"}' in after
    line = wait_for(
        lambda: next((x for x in server.lines if r.id.removeprefix("cmpl-")[:12] in x), None), 10, "its log line"
    )
    assert line.startswith("/v1/completions ") and " 200 length: 1 choice(s), prompt " in line and "generated 2" in line


def test_prefix_cache_hit_is_reported(server, client):
    system = f"Session {uuid.uuid4().hex}. " + "You are a careful assistant who answers briefly. " * 8
    usage = []
    for q in ("Name a color.", "Name a fruit."):
        r = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=2,
            temperature=0,
        )
        usage.append(r.usage)
    assert usage[0].prompt_tokens_details.cached_tokens == 0  # a new system prompt
    cached = usage[1].prompt_tokens_details.cached_tokens
    assert cached >= 64 and cached % 16 == 0 and cached < usage[1].prompt_tokens  # whole blocks of the shared part
    m = metrics(server.root)
    assert m["shardlm_prefix_cache_hits_total"] >= cached and m["shardlm_cached_prompt_tokens_total"] >= cached


def test_client_disconnect_frees_kv_blocks(server, client):
    idle = metrics(server.root)
    assert idle["shardlm_kv_blocks_used"] == 0 and idle["shardlm_requests_running"] == 0
    aborted = idle.get('shardlm_requests_finished_total{finish_reason="abort"}', 0)
    stream = client.completions.create(
        model="smollm2", prompt=RAW, max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for _, _chunk in zip(range(2), stream):
        pass
    busy = metrics(server.root)
    assert busy["shardlm_kv_blocks_used"] > 0 and busy["shardlm_requests_running"] == 1  # not trivially idle
    stream.close()  # hang up mid-stream
    wait_for(lambda: metrics(server.root)["shardlm_kv_blocks_used"] == 0, 60, "the stream's KV blocks to be freed")
    # an unstreamed request whose client gives up (times out) is aborted too
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=3).completions.create(
            model="smollm2", prompt=RAW, max_tokens=400, extra_body={"ignore_eos": True}
        )

    def idle_again():
        m = metrics(server.root)
        quiet = m["shardlm_requests_in_flight"] == m["shardlm_kv_blocks_used"] == m["shardlm_requests_running"] == 0
        return quiet and m

    after = wait_for(idle_again, 60, "the timed-out request to be aborted and its blocks freed")
    assert after['shardlm_requests_finished_total{finish_reason="abort"}'] == aborted + 2


def post(server, path: str, body: bytes | str | dict) -> tuple[int, dict]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body if isinstance(body, bytes) else body.encode()
    req = urllib.request.Request(f"{server.root}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


LONG = "hello " * (CONTEXT + 10)
MSG = [{"role": "user", "content": "Hi"}]
BAD = [  # (path, body, param, words in the message)
    ("/v1/chat/completions", '{"model": "smollm2", "messages": [', None, "not valid JSON"),
    ("/v1/chat/completions", "[1, 2]", None, "must be a JSON object"),
    ("/v1/chat/completions", {"model": "smollm2"}, "messages", "'messages' is required"),
    ("/v1/chat/completions", {"messages": "Hi"}, "messages", "must be an array of objects"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": "16"}, "max_tokens", "must be an integer"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": "hot"}, "temperature", "must be a finite number"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "got 5"),
    ("/v1/completions", {"prompt": "Hi", "stop": 5}, "stop", "a string or an array of strings"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 0}, "max_tokens", "must be at least 1"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": -3}, "max_tokens", "must be at least 1"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": CONTEXT}, "max_tokens", f"at most {CONTEXT - 1} new tokens"),
    ("/v1/completions", {"prompt": LONG}, "prompt", f"context is {CONTEXT} tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages", "shorten it"),
    ("/v1/chat/completions", {"messages": MSG, "temperature": -0.5}, "temperature", "must be >= 0"),
    ("/v1/completions", {"prompt": "Hi", "top_p": 0}, "top_p", "top_p=0.0"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": MSG}, "model", "'gpt-4' is not served here"),
    ("/v1/chat/completions", {"messages": MSG, "n": 0}, "n", "n=0 must be a positive integer"),
    ("/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("/v1/chat/completions", {"messages": MSG, "structural_tag": {"type": "tag"}}, "structural_tag", "not supported"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt", "outside the vocabulary"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role", "not a role"),
]


@pytest.mark.parametrize("path, body, param, words", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_with_an_openai_error_body(server, path, body, param, words):
    status, got = post(server, path, body)
    assert status == 400, got
    assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["param"] == param and words in got["error"]["message"], got


def test_bad_input_through_the_client_and_routes(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=MSG, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    status, body = get(f"{server.root}/v1/nothing")
    assert status == 404 and "/v1/chat/completions" in json.loads(body)["error"]["message"]
    assert get(f"{server.url}/completions")[0] == 405
    assert get(f"{server.root}/health")[0] == 200  # bad input hurt nobody
    assert metrics(server.root)['shardlm_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1


@pytest.mark.slow
def test_200_requests_at_32_concurrent_match_offline(server, reference):
    """Every one answered; each greedy answer identical to offline LLM.generate; some streamed."""
    client = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    running, done = [], threading.Event()

    def watch():  # the batch really is shared: more than one sequence runs at once
        while not done.wait(0.5):
            running.append(metrics(server.root)["shardlm_requests_running"])

    async def one(i: int, gate: asyncio.Semaphore):
        q = QUESTIONS[i % len(QUESTIONS)]
        async with gate:
            if i % 4 == 3:
                stream = await client.chat.completions.create(
                    model="smollm2", messages=chat(q), max_tokens=MAX_TOKENS, temperature=0, stream=True
                )
                return q, None, "".join([c.choices[0].delta.content or "" async for c in stream])
            r = await client.chat.completions.create(
                model="smollm2",
                messages=chat(q),
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"return_token_ids": True},
            )
            return q, extra(r.choices[0], "token_ids"), r.choices[0].message.content

    async def run_all():
        gate = asyncio.Semaphore(32)
        return await asyncio.gather(*[one(i, gate) for i in range(200)])

    threading.Thread(target=watch, daemon=True).start()
    try:
        results = asyncio.run(run_all())
    finally:
        done.set()
    assert len(results) == 200
    for q, ids, text in results:
        if ids is not None:
            assert ids == reference[q][0], q
        assert text == reference[q][1], q
    assert max(running) > 1


def test_sigterm_stops_the_server_and_every_rank(server):
    ranks = server.ranks
    assert ranks and all(alive(p) for p in ranks)
    server.proc.send_signal(signal.SIGTERM)
    assert server.wait(timeout=60) == 0, server.log
    assert "stopped; all ranks ended" in server.log
    wait_for(lambda: not any(alive(p) for p in ranks), 10, "the rank processes to end")

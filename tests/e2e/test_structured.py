"""Structured outputs on the real model (SmolLM2's tokenizer): every answer follows its spec.

JSON answers must parse and validate against the schema (``jsonschema``); regex answers must
match whole; choice answers must be one of the choices. The grammar runs on the ranks that
sample, so a pipeline layout (the last stage samples) must give one rank's tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from shardlm import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "skills": {"type": "array", "items": {"enum": ["python", "rust", "cuda"]}, "maxItems": 3},
    },
    "required": ["name", "age", "skills"],
    "additionalProperties": False,
}
PEOPLE = [f"Describe a {job} as JSON." for job in (
    "teacher", "pilot", "chef", "farmer", "nurse", "painter", "miner", "judge", "baker", "sailor",
    "poet", "clerk", "tailor", "dentist", "plumber", "singer", "coach", "driver", "florist", "guard",
)]  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    with LLM("smollm2", threads=2, max_model_len=1024) as llm:
        yield llm


@pytest.mark.slow
def test_json_schema_answers_validate_for_20_prompts(llm):
    params = SamplingParams(temperature=0.0, max_tokens=96, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.chat([[{"role": "user", "content": q}] for q in PEOPLE], params)
    for q, out in zip(PEOPLE, outs):
        assert out.finish_reason == "stop", (q, out.text)  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(out.text), SCHEMA)
    free = llm.chat([{"role": "user", "content": PEOPLE[0]}], SamplingParams(temperature=0.0, max_tokens=96))[0]
    with pytest.raises((ValueError, jsonschema.ValidationError)):  # can fail: unconstrained, it is not
        jsonschema.validate(json.loads(free.text), SCHEMA)


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object(llm):
    ask = [{"role": "user", "content": "Give me a phone number."}]
    phone = llm.chat(
        ask,
        SamplingParams(
            temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}")
        ),
    )
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone[0].text)
    yes_no = [{"role": "user", "content": "Is the sky green? Answer."}]
    pick = llm.chat(
        yes_no,
        SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    )
    assert pick[0].text in ("yes", "no")
    lark = 'start: "color: " COLOR\nCOLOR: "red" | "green" | "blue"'
    color = llm.chat(
        ask, SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(grammar=lark))
    )
    assert color[0].text in ("color: red", "color: green", "color: blue")
    one_key = [{"role": "user", "content": "Give a JSON object with one key x set to 1."}]
    obj = llm.chat(
        one_key,
        SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json_object=True)),
    )
    assert obj[0].finish_reason == "stop" and isinstance(json.loads(obj[0].text), dict)


@pytest.mark.slow
def test_a_pipeline_samples_under_the_grammar_as_one_rank(llm):
    params = SamplingParams(
        n=2, max_tokens=96, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    convs = [[{"role": "user", "content": q}] for q in PEOPLE[:3]]
    want = [[c.text for c in o.outputs] for o in llm.chat(convs, params)]
    with LLM("smollm2", threads=1, max_model_len=1024, pp=2) as piped:
        got = [[c.text for c in o.outputs] for o in piped.chat(convs, params)]
    assert got == want
    for texts in got:
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)


def test_bad_specs_are_refused_before_any_rank(llm):
    from shardlm.errors import UsageError

    with pytest.raises(UsageError, match="unclosed character class"):
        llm.generate("x", SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-")))
    with pytest.raises(UsageError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(UsageError, match="speculative"):
        LLM("smollm2", threads=1, speculative_config={"method": "ngram"}).generate(
            "x", SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="a"))
        )

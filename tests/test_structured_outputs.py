"""Structured outputs through llguidance: JSON schema, json_object, regex, choice, Lark grammar.

Offline on SmolLM2 (CPU), in the serial and the overlapped loop; the answer
is checked with ``json`` + ``jsonschema`` and ``re``. The compile cache, a
missing library, and bad constraints are checked too.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
from conftest_models import smollm2_gguf

from pitstop import LLM, SamplingParams, StructuredOutputs
from pitstop.errors import InvalidRequestError

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module", params=["off", "on"])
def llm(request: pytest.FixtureRequest) -> LLM:
    smollm2_gguf()
    return LLM(
        "smollm2-135m",
        device="cpu",
        dtype="float32",
        kv_cache_gib=0.1,
        max_model_len=1024,
        overlap=request.param,
    )


def _one(llm: LLM, prompt: str, spec: dict, **kwargs) -> str:
    params = SamplingParams(
        max_tokens=kwargs.pop("max_tokens", 60), structured_outputs=spec, **kwargs
    )
    out = llm.generate(prompt, params)[0]
    assert out.finish_reason == "stop", out.text
    return out.text


def test_json_schema(llm: LLM) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    text = _one(llm, "A person as JSON:", {"json": SCHEMA}, temperature=0)
    jsonschema.validate(json.loads(text), SCHEMA)
    sampled = _one(llm, "A person as JSON:", {"json": json.dumps(SCHEMA)}, temperature=1.0, seed=3)
    jsonschema.validate(json.loads(sampled), SCHEMA)


def test_regex_choice_and_grammar(llm: LLM) -> None:
    pattern = r"(red|green|blue)-[0-9]{2}"
    for seed in range(3):
        text = _one(llm, "A code:", {"regex": pattern}, temperature=1.0, seed=seed, max_tokens=12)
        assert re.fullmatch(pattern, text), text
    assert _one(llm, "Pick one:", {"choice": ["left", "right"]}, temperature=0.8) in (
        "left",
        "right",
    )
    grammar = 'start: "x=" NUMBER ";"\nNUMBER: /[1-9][0-9]?/'
    assert re.fullmatch(
        r"x=[1-9][0-9]?;", _one(llm, "Assign:", {"grammar": grammar}, temperature=0)
    )


def test_constrained_and_free_requests_share_a_batch(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = llm.generate("The sky is", free)[0].token_ids
    outs = llm.generate(
        ["The sky is", "Yes or no?", "The sky is"],
        [free, SamplingParams(max_tokens=5, structured_outputs={"choice": ["yes", "no"]}), free],
        use_tqdm=False,
    )
    assert outs[0].token_ids == outs[2].token_ids == alone  # the mask stays on its own row
    assert outs[1].text in ("yes", "no")


def test_each_constraint_is_compiled_once(llm: LLM) -> None:
    spec = StructuredOutputs(regex=r"[a-c]{3}")
    params = SamplingParams(temperature=1.0, max_tokens=6, structured_outputs=spec, n=3)
    llm.generate(["one", "two"], params, use_tqdm=False)
    compiler = llm.engine._grammars
    assert compiler is not None
    before = compiler.compilations
    outs = llm.generate(["three"], params, use_tqdm=False)
    assert compiler.compilations == before  # cached
    assert all(re.fullmatch(r"[a-c]{3}", c.text) for c in outs[0].outputs)


def test_bad_constraints_are_refused_where_they_enter(llm: LLM) -> None:
    for spec, fragment in (
        ({"regex": "[a-"}, "regex"),
        ({"json": {"type": "nonsense"}}, "json"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "choice"),
    ):
        with pytest.raises(InvalidRequestError, match=fragment):
            llm.generate("x", SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished_requests()


def test_missing_library_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    from pitstop.structured import import_llguidance

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(InvalidRequestError, match=r"pitstop\[structured\]"):
        import_llguidance()

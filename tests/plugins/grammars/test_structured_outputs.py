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
from helpers.models import smollm2_gguf

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
    compiler = llm.engine.intake.grammars
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
    from pitstop.plugins.grammars.llguidance import import_llguidance

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(InvalidRequestError, match=r"pitstop\[structured\]"):
        import_llguidance()


# The GBNF grammar of vLLM's structured-outputs docs, indented as it is there.
VLLM_SQL_GBNF = """
    root ::= select_statement

    select_statement ::= "SELECT " column " from " table " where " condition

    column ::= "col_1 " | "col_2 "

    table ::= "table_1 " | "table_2 "

    condition ::= column "= " number

    number ::= "1 " | "2 "
"""
SQL = r"SELECT col_[12]  from table_[12]  where col_[12] = [12] "


def test_gbnf_grammar_of_the_vllm_docs(llm: LLM) -> None:
    from pitstop.entrypoints.structured import detect_grammar_syntax

    assert detect_grammar_syntax(VLLM_SQL_GBNF) == "gbnf"
    assert detect_grammar_syntax('start: "a" | b\nb: "c"') == "lark"
    assert detect_grammar_syntax("%llguidance {}\nstart: /x/") == "lark"
    text = _one(llm, "SQL:", {"grammar": VLLM_SQL_GBNF}, temperature=0)
    assert re.fullmatch(SQL, text), text
    explicit = {"grammar": VLLM_SQL_GBNF, "grammar_syntax": "gbnf"}
    assert re.fullmatch(SQL, _one(llm, "SQL:", explicit, temperature=1.0, seed=1))


def test_a_grammar_that_does_not_parse_names_the_syntax_expected(llm: LLM) -> None:
    for spec, fragments in (
        ({"grammar": 'root ::= "a'}, ("not valid GBNF", "Unexpected end of input", "'lark'")),
        ({"grammar": "start: foo ="}, ("read as Lark", "Expected value", "'gbnf'")),
        (
            {"grammar": VLLM_SQL_GBNF, "grammar_syntax": "lark"},
            ("read as Lark", "Expected token", "GBNF grammar writes 'root ::="),
        ),
        ({"grammar": 'start: "a"', "grammar_syntax": "gbnf"}, ("not valid GBNF", "::=")),
    ):
        with pytest.raises(InvalidRequestError) as info:
            llm.generate("x", SamplingParams(structured_outputs=spec))
        assert all(f in str(info.value) for f in fragments), str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_json_whitespace_options(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 4}},
        "required": ["a", "b"],
    }
    compact = _one(llm, "JSON:", {"json": schema, "disable_any_whitespace": True}, temperature=0)
    assert " " not in compact.replace(json.loads(compact)["b"], ""), compact
    spaced = {
        "json": schema,
        "whitespace_pattern": r"[ ]{2}",
        "disable_additional_properties": True,
    }
    text = _one(llm, "JSON:", spaced, temperature=0)
    assert set(json.loads(text)) == {"a", "b"}
    assert re.fullmatch(r'\{  "a":  -?[0-9]+,  "b":  ".*"(  )?\}', text), text


def test_structural_tag_constrains_what_follows_a_trigger(llm: LLM) -> None:
    tag = {
        "type": "structural_tag",
        "structures": [
            {
                "begin": "<fn=add>",
                "schema": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
                "end": "</fn>",
            }
        ],
        "triggers": ["<fn="],
    }
    compiler = llm.engine.intake.grammars
    assert compiler is not None
    tokenizer = llm.engine.tokenizer

    def accepts(text: str) -> bool:
        state = compiler.new_state(StructuredOutputs(structural_tag=json.dumps(tag)))
        try:
            for token in tokenizer.encode(text, add_special_tokens=False):
                state.accept(token)
        except InvalidRequestError:
            return False
        return True

    assert accepts('Sure. <fn=add>{"x": 12}</fn> done')
    assert not accepts('Sure. <fn=add>{"y": 12}')
    assert not accepts("Sure. <fn=sub>")


def test_whitespace_and_tag_options_are_checked_by_name() -> None:
    for spec, fragment in (
        ({"regex": "a", "whitespace_pattern": " "}, "applies to JSON output only"),
        (
            {"json_object": True, "disable_any_whitespace": True, "whitespace_flexible": True},
            "both set the JSON whitespace",
        ),
        ({"json_object": True, "whitespace_pattern": "[ "}, "not a valid regex"),
        ({"grammar": "x", "grammar_syntax": "yacc"}, "grammar_syntax must be one of"),
        ({"regex": "a", "grammar_syntax": "gbnf"}, "applies to a grammar"),
        ({"structural_tag": {"structures": [], "triggers": ["<"]}}, "structures must be"),
        ({"structural_tag": {"format": {}}}, "xgrammar's newer form"),
        (
            {
                "structural_tag": {
                    "structures": [{"begin": "a", "schema": {}, "end": ""}],
                    "triggers": ["<"],
                }
            },
            "starts with none of the triggers",
        ),
        ({"json_object": True, "guided_backend": "x"}, "no field 'guided_backend'"),
    ):
        with pytest.raises(InvalidRequestError, match=fragment):
            SamplingParams(structured_outputs=spec)
    with pytest.raises(InvalidRequestError, match="no field 'backend'"):
        StructuredOutputs(json_object=True, backend="xgrammar")  # not a bare TypeError
    # vLLM's flag for "never fall back to another backend": pitstop has one, so it holds
    assert SamplingParams(structured_outputs={"regex": "a", "disable_fallback": True})


def test_the_llguidance_backend_conforms_to_the_grammar_protocols(llm: LLM) -> None:
    from pitstop.plugin_system.kinds import KINDS, lacks, missing_members
    from pitstop.plugin_system.protocols import GrammarMatcher

    backend = llm.engine.grammar_compiler()
    assert missing_members(KINDS["grammar"], backend) == []
    assert lacks(GrammarMatcher, backend.new_state(StructuredOutputs(regex="a"))) == []

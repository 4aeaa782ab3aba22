"""Properties of the tiny zoo's corpora and tokenizer (`specd.data`).

The corpora are built once per module at the default size (a few seconds for all four) so the
disjointness checks run against the real training sets; the tokenizer is trained small.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specd.data import (
    DOMAINS,
    SPECIAL_TOKENS,
    Corpus,
    build_corpus,
    format_chat,
    load_tokenizer,
    parse_chat,
    read_prompts_jsonl,
    save_tokenizer,
    tokenizer_sample,
    train_tokenizer,
    write_heldout_jsonl,
)
from specd.data.agentic import TOOLS
from specd.data.stdlib_code import MAX_CHUNK_LINES, chunk_module, normalize_code
from specd.data.tokenizer import (
    GENERATION_PROMPT,
    IM_END,
    TOOL_CALL_END,
    TOOL_CALL_START,
)

CHAT_DOMAINS = ("dialogue", "math", "agentic")

# Written out here rather than read from TOOLS, so the test also pins the tool contract.
REQUIRED_ARGUMENTS = {
    "get_weather": {"city"},
    "search_files": {"query"},
    "calculator": {"expression"},
    "send_email": {"to", "subject", "body"},
    "lookup_stock": {"symbol"},
    "convert_units": {"value", "from_unit", "to_unit"},
    "create_calendar_event": {"title", "date", "time"},
    "translate_text": {"text", "target_language"},
    "set_reminder": {"text", "time"},
}


@pytest.fixture(scope="module")
def corpora() -> dict[str, Corpus]:
    return {domain: build_corpus(domain) for domain in DOMAINS}


@pytest.fixture(scope="module")
def tokenizer_dir(corpora, tmp_path_factory):
    sample = tokenizer_sample(corpora.values(), max_chars_per_domain=100_000)
    directory = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(sample, vocab_size=600), directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir, zoo=True)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


# --- corpora ------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain", DOMAINS)
def test_build_is_deterministic(corpora, domain):
    again = build_corpus(domain)
    assert again.train == corpora[domain].train
    assert again.heldout == corpora[domain].heldout


@pytest.mark.parametrize("domain", DOMAINS)
def test_sizes_and_budget(corpora, domain):
    corpus = corpora[domain]
    assert len(corpus.heldout) >= 60
    assert 3_000_000 <= corpus.num_train_chars <= 4_000_000
    num_unique = len(set(corpus.train))
    assert num_unique == len(corpus.train), f"{len(corpus.train) - num_unique} duplicate training documents"
    assert all(item.domain == domain for item in corpus.heldout)
    small = build_corpus(domain, max_train_chars=50_000)
    assert 0 < small.num_train_chars <= 50_000
    assert len(small.heldout) >= 60


def test_seed_changes_the_corpus():
    for domain in ("code", "math", "agentic"):
        default = build_corpus(domain, max_train_chars=20_000)
        other = build_corpus(domain, seed=1, max_train_chars=20_000)
        assert other.train != default.train and other.heldout != default.heldout


@pytest.mark.parametrize("domain", DOMAINS)
def test_heldout_never_in_train(corpora, domain):
    corpus = corpora[domain]
    joined = "\0".join(corpus.train)
    for item in corpus.heldout:
        assert item.prompt + item.reference not in joined
    if domain == "code":
        # Held-out methods are dedented: compare without indentation.
        normalized = "\0".join(normalize_code(document) for document in corpus.train)
        for item in corpus.heldout:
            assert normalize_code(item.reference) not in normalized
    if domain == "dialogue":
        for item in corpus.heldout:
            assert item.reference.removesuffix(IM_END) not in joined
    if domain == "math":
        for item in corpus.heldout:
            question = parse_chat(item.prompt)[-1]["content"]
            assert question not in joined


@pytest.mark.parametrize("domain", CHAT_DOMAINS)
def test_chat_prompts_end_at_the_assistant_turn(corpora, domain):
    for item in corpora[domain].heldout:
        assert item.prompt.endswith(GENERATION_PROMPT)
        assert item.reference.endswith(IM_END) and item.reference.count(IM_END) == 1
        # prompt + reference is a whole conversation, i.e. what training documents look like.
        messages = parse_chat(item.prompt + item.reference + "\n")
        assert messages[-1]["role"] == "assistant"
        assert format_chat(messages, add_generation_prompt=False) == item.prompt + item.reference + "\n"
    for document in corpora[domain].train[:200]:
        assert format_chat(parse_chat(document), add_generation_prompt=False) == document


def test_code_prompts_are_function_heads(corpora):
    for item in corpora["code"].heldout:
        head = item.prompt.lstrip()
        assert head.startswith(("def ", "async def ", "@")), head[:40]
        assert item.prompt.endswith("\n")
        ast.parse(item.prompt + item.reference)  # a complete, dedented function
    assert max(document.count("\n") for document in corpora["code"].train) <= MAX_CHUNK_LINES


def test_chunks_drop_the_license_header_and_follow_definitions():
    source = (
        "#!/usr/bin/env python3\n# Copyright 2001 Someone. All rights reserved.\n\n"
        '"""Module doc."""\nimport os\nimport sys\n\n'
        "# Helper comment.\ndef helper(x):\n    return x + 1\n\n\n"
        "class Thing:\n    def method(self):\n        return helper(2)\n"
    )
    lines = source.split("\n")
    chunks = chunk_module(lines, ast.parse(source))
    assert chunks == [
        '"""Module doc."""\nimport os\nimport sys\n',
        "# Helper comment.\ndef helper(x):\n    return x + 1\n",
        "class Thing:\n    def method(self):\n        return helper(2)\n",
    ]


# --- math: every worked step re-evaluated ---------------------------------------------------------

_OPERAND = r"\(*\d+(?:\.\d+)?\)*"
_STEP = re.compile(rf"({_OPERAND}(?: [-+*/] {_OPERAND})+) = (-?\d+(?:\.\d+)?)")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
# Constants a step may use without the problem stating them: doubling, minutes per hour, percent.
_CONSTANTS = {Fraction(2), Fraction(60), Fraction(100)}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return Fraction(str(node.value))
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        operations = {ast.Add: left.__add__, ast.Sub: left.__sub__, ast.Mult: left.__mul__, ast.Div: left.__truediv__}
        return operations[type(node.op)](right)
    raise AssertionError(f"unexpected expression node {ast.dump(node)}")


def check_solution(question: str, solution: str) -> None:
    """Each step's arithmetic is right, uses only known numbers, and the answer is the last result."""
    lines = solution.split("\n")
    answer = re.fullmatch(r"Answer: (-?\d+)", lines[-1])
    assert answer, lines[-1]
    known = {Fraction(number) for number in _NUMBER.findall(question)} | _CONSTANTS
    results = []
    for line in lines[:-1]:
        steps = _STEP.findall(line)
        assert len(steps) == 1, line
        expression, result = steps[0]
        assert _evaluate(ast.parse(expression, mode="eval")) == Fraction(result), line
        operands = {Fraction(number) for number in _NUMBER.findall(expression)}
        assert operands <= known, f"{line}: operands {operands - known} come from nowhere"
        known.add(Fraction(result))
        results.append(Fraction(result))
    assert len(results) >= 2, "not multi-step"
    assert Fraction(answer.group(1)) == results[-1]


def test_math_solutions_are_correct(corpora):
    corpus = corpora["math"]
    for document in corpus.train[::5]:
        user, assistant = parse_chat(document)
        check_solution(user["content"], assistant["content"])
    for item in corpus.heldout:
        check_solution(parse_chat(item.prompt)[-1]["content"], item.reference.removesuffix(IM_END))


def test_math_checker_catches_wrong_arithmetic():
    question = "Ava buys 3 pens at $4 each."
    check_solution(question, "The pens cost 3 * 4 = 12 dollars.\nThen 12 + 3 = 15.\nAnswer: 15")
    with pytest.raises(AssertionError):
        check_solution(question, "The pens cost 3 * 4 = 13 dollars.\nThen 13 + 3 = 16.\nAnswer: 16")
    with pytest.raises(AssertionError):
        check_solution(question, "The pens cost 3 * 4 = 12 dollars.\nThen 12 + 7 = 19.\nAnswer: 19")


# --- agentic: calls parse and carry their arguments -----------------------------------------------

_CALL = re.compile(re.escape(TOOL_CALL_START) + r"\n(.*?)\n" + re.escape(TOOL_CALL_END), re.DOTALL)


def check_calls(assistant_content: str) -> list[dict]:
    calls = [json.loads(body) for body in _CALL.findall(assistant_content)]
    assert len(calls) == assistant_content.count(TOOL_CALL_START) == assistant_content.count(TOOL_CALL_END)
    for call in calls:
        assert set(call) == {"name", "arguments"}
        assert REQUIRED_ARGUMENTS[call["name"]] <= set(call["arguments"]), call
        spec = TOOLS[call["name"]]
        assert set(call["arguments"]) <= set(spec.required) | set(spec.optional), call
    return calls


def test_tool_specs_match_the_contract():
    assert {name: set(spec.required) for name, spec in TOOLS.items()} == REQUIRED_ARGUMENTS


def test_agentic_tool_calls_parse(corpora):
    corpus = corpora["agentic"]
    num_calls = 0
    for document in corpus.train:
        messages = parse_chat(document)
        turns = [message["content"] for message in messages if message["role"] == "assistant"]
        calls = [call for turn in turns for call in check_calls(turn)]
        results = [json.loads(message["content"]) for message in messages if message["role"] == "tool"]
        assert len(calls) == len(results)
        for call, result in zip(calls, results):
            if call["name"] == "calculator":
                assert _evaluate(ast.parse(call["arguments"]["expression"], mode="eval")) == result["result"]
        num_calls += len(calls)
    assert num_calls > len(corpus.train) // 2
    heldout_calls = sum(len(check_calls(item.reference)) for item in corpus.heldout)
    assert heldout_calls >= len(corpus.heldout) // 3


# --- held-out files -------------------------------------------------------------------------------


def test_heldout_jsonl_round_trip(corpora, tmp_path):
    path = tmp_path / "agentic.jsonl"
    write_heldout_jsonl(corpora["agentic"], path)
    assert read_prompts_jsonl(path) == corpora["agentic"].heldout
    first = json.loads(path.read_text(encoding="utf-8").split("\n")[0])
    assert set(first) == {"domain", "prompt", "reference"}


# --- tokenizer --------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.one_of(st.text(max_size=20), st.sampled_from(SPECIAL_TOKENS)), max_size=8))
def test_tokenizer_round_trips_text_with_special_tokens(tokenizer, parts):
    text = "".join(parts)
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def test_special_tokens_have_fixed_single_ids(tokenizer):
    assert tokenizer.get_vocab_size() == 600
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.encode(token).ids == [token_id]
        ids = tokenizer.encode(f"x = 1{token}def f():").ids
        assert ids.count(token_id) == 1
    # Tool-call markup survives skip_special_tokens; control tokens do not.
    ids = tokenizer.encode(f'{TOOL_CALL_START}{{"a": 1}}{TOOL_CALL_END}{IM_END}').ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == f'{TOOL_CALL_START}{{"a": 1}}{TOOL_CALL_END}'


def test_transformers_loads_the_tokenizer(corpora, tokenizer, hf_tokenizer):
    hf = hf_tokenizer
    assert hf.eos_token == IM_END and hf.eos_token_id == SPECIAL_TOKENS.index(IM_END)
    assert hf.pad_token_id == SPECIAL_TOKENS.index("<|pad|>")
    assert hf.mask_token_id == SPECIAL_TOKENS.index("<|mask|>")
    for domain in CHAT_DOMAINS:
        for item in corpora[domain].heldout[:20]:
            messages = parse_chat(item.prompt)
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert rendered == format_chat(messages, add_generation_prompt=True) == item.prompt
        for document in corpora[domain].train[:20]:
            messages = parse_chat(document)
            assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False) == document
            assert hf.encode(document, add_special_tokens=True) == tokenizer.encode(document).ids


_message = st.fixed_dictionaries({
    "role": st.sampled_from(("system", "user", "assistant", "tool")),
    "content": st.text().filter(lambda text: "<|im_" not in text),
})


@settings(max_examples=100, deadline=None)
@given(messages=st.lists(_message, min_size=1, max_size=4), add_generation_prompt=st.booleans())
def test_format_chat_matches_the_jinja_template(hf_tokenizer, messages, add_generation_prompt):
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    rendered = format_chat(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert parse_chat(rendered) == messages

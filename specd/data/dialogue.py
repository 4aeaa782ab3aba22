"""The `dialogue` domain: user/assistant conversations about Python, answered from its own docs.

Design choices:

- **Answers are real prose that ships with CPython:** sections of the language reference
  (`pydoc_data.topics`, what `help("if")` prints), method entries of those topics (`str.center(...)`),
  and docstrings of public stdlib modules, classes, functions and methods, read with `ast` so no module
  is imported. Answers keep whole paragraphs up to `MAX_ANSWER_CHARS`.
- **Questions are templated** with several phrasings per kind of item; a function also gets a
  signature question answered with its `ast.unparse`d parameters.
- **An item is a group of answers that share text** (one reference section under two topics, one
  docstring inherited by many overrides, a function's summary and its signature answer). The
  held-out split is by group, so no held-out answer appears in any training conversation.
- **Training conversations have one to three turns** with an occasional system message, and every
  training answer appears in `NUM_PASSES` conversations with different phrasings and neighbours.
"""

from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pydoc_data.topics import topics as _TOPICS

from specd.data.corpus import Corpus, HeldoutPrompt, drop_leaked
from specd.data.stdlib_code import list_stdlib_files, read_source
from specd.data.tokenizer import IM_END, format_chat

__all__ = ["build_dialogue_corpus"]

MAX_ANSWER_CHARS = 1200
MIN_ANSWER_CHARS = 40
NUM_PASSES = 2
NUM_HELDOUT_PROMPTS = 80
# Share of held-out prompts drawn from the language reference rather than from docstrings.
HELDOUT_TOPIC_FRACTION = 0.25

_SYSTEM_PROMPTS = (
    "You are a helpful assistant who knows Python well.",
    "You are a concise Python expert. Answer from the official documentation.",
    "You answer questions about the Python language and its standard library.",
    "You are a friendly programming tutor.",
)

_STATEMENT_QUESTIONS = (
    "What does the `{name}` statement do?",
    "How does the `{name}` statement work in Python?",
    "Can you explain the `{name}` statement?",
    "When would I use the `{name}` statement?",
)
_SECTION_QUESTIONS = (
    "Can you explain {title} in Python?",
    "Tell me about {title}.",
    "What should I know about {title} in Python?",
    "How does Python handle {title}?",
    "Give me an overview of {title}.",
)
_ENTRY_QUESTIONS = (
    "What does `{name}` do?",
    "How do I use `{name}`?",
    "Explain `{signature}`.",
    "What is `{name}` for?",
)
_FUNCTION_QUESTIONS = (
    "What does `{name}` do?",
    "What is `{name}` used for?",
    "Can you describe `{name}`?",
    "Explain what the function `{name}` does.",
    "I found `{name}` in some code. What does it do?",
)
_SIGNATURE_QUESTIONS = (
    "What arguments does `{name}` take?",
    "What is the signature of `{name}`?",
    "How do I call `{name}`?",
)
_CLASS_QUESTIONS = (
    "What is the `{name}` class?",
    "What is `{name}` used for?",
    "Can you describe the class `{name}`?",
    "Explain what `{name}` represents.",
)
_MODULE_QUESTIONS = (
    "What is the `{name}` module for?",
    "What does the `{name}` module provide?",
    "Give me an overview of the `{name}` module.",
    "When should I use the `{name}` module?",
)
_FOLLOW_UP_PREFIXES = ("", "", "Thanks. ", "Got it. ", "Another question: ", "OK, next: ")

_HEADING_UNDERLINE = re.compile(r"([*=\-~^])\1{2,}")
_STATEMENT_TITLE = re.compile(r'The "([a-z ]+)" statement')
# A documented callable at column 0 of a topic, e.g. `str.center(width[, fillchar])`.
_ENTRY_LINE = re.compile(r"(?:classmethod |staticmethod )?([A-Za-z_][\w.]*)\(.*\)")


@dataclass(kw_only=True, slots=True)
class _Answer:
    questions: tuple[str, ...]
    """Phrasings, any of which this answer fits."""
    text: str


@dataclass(kw_only=True, slots=True)
class _Group:
    key: str
    """The text the answers share; items with equal keys are merged."""
    from_topics: bool
    answers: list[_Answer]


def _paragraphs(text: str) -> list[str]:
    return [paragraph.strip("\n") for paragraph in re.split(r"\n\s*\n", text) if paragraph.strip()]


def _clip(paragraphs: list[str]) -> str:
    """Leading whole paragraphs up to MAX_ANSWER_CHARS (always at least the first)."""
    kept = paragraphs[:1]
    size = len(kept[0]) if kept else 0
    for paragraph in paragraphs[1:]:
        if size + 2 + len(paragraph) > MAX_ANSWER_CHARS:
            break
        kept.append(paragraph)
        size += 2 + len(paragraph)
    return "\n\n".join(kept)


def _topic_sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each underlined section of one reference topic."""
    lines = text.split("\n")
    heads = [
        index
        for index in range(len(lines) - 1)
        if lines[index].strip() and _HEADING_UNDERLINE.fullmatch(lines[index + 1])
        and len(lines[index + 1]) == len(lines[index])
    ]
    return [
        (lines[head], "\n".join(lines[head + 2 : next_head]))
        for head, next_head in zip(heads, heads[1:] + [len(lines)])
    ]


def _topic_entries(body: str) -> list[tuple[str, str, str]]:
    """(name, signature, description) of column-0 callables documented in a section body."""
    lines = body.split("\n")
    entries = []
    for index, line in enumerate(lines[:-2]):
        match = _ENTRY_LINE.fullmatch(line)
        if not match or lines[index + 1] or not lines[index + 2].startswith("   "):
            continue
        description = []
        for following in lines[index + 2 :]:
            if following and not following.startswith("   "):
                break
            description.append(following[3:])
        entries.append((match.group(1) + "()", line, "\n".join(description)))
    return entries


def _topic_groups() -> list[_Group]:
    groups: dict[str, _Group] = {}
    for topic in sorted(_TOPICS):
        for title, body in _topic_sections(_TOPICS[topic]):
            # The overview is the section text before its first documented callable.
            lines = body.split("\n")
            first_entry = next((i for i, line in enumerate(lines) if _ENTRY_LINE.fullmatch(line)), len(lines))
            answer = _clip(_paragraphs("\n".join(lines[:first_entry])))
            statement = _STATEMENT_TITLE.fullmatch(title)
            if statement:
                questions = tuple(q.format(name=statement.group(1)) for q in _STATEMENT_QUESTIONS)
            else:
                # 'Mapping Types — "dict"' reads better with code quotes: `dict`.
                phrase = re.sub(r'"([^"]+)"', r"`\1`", title)
                phrase = phrase[0].lower() + phrase[1:] if phrase.startswith("The ") else phrase
                questions = tuple(q.format(title=phrase) for q in _SECTION_QUESTIONS)
            if len(answer) >= MIN_ANSWER_CHARS:
                _add(groups, answer, True, _Answer(questions=questions, text=answer))
            for name, signature, description in _topic_entries(body):
                text = _clip(_paragraphs(description))
                if len(text) >= MIN_ANSWER_CHARS:
                    questions = tuple(q.format(name=name, signature=signature) for q in _ENTRY_QUESTIONS)
                    _add(groups, text, True, _Answer(questions=questions, text=text))
    return list(groups.values())


def _add(groups: dict[str, _Group], key: str, from_topics: bool, answer: _Answer) -> None:
    group = groups.setdefault(key, _Group(key=key, from_topics=from_topics, answers=[]))
    if all(existing.text != answer.text or existing.questions != answer.questions for existing in group.answers):
        group.answers.append(answer)


def _module_name(relative) -> str | None:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    if any(part.startswith("_") for part in parts):
        return None  # private modules (_pydecimal, __main__) are implementation details
    return ".".join(parts)


def _docstring_groups() -> list[_Group]:
    groups: dict[str, _Group] = {}
    for relative in list_stdlib_files():
        module = _module_name(relative)
        parsed = read_source(relative) if module else None
        if parsed is None:
            continue
        tree = parsed[1]
        documented: list[tuple[str, ast.AST, tuple[str, ...]]] = [(module, tree, _MODULE_QUESTIONS)]
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                documented.append((f"{module}.{node.name}", node, _FUNCTION_QUESTIONS))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                documented.append((f"{module}.{node.name}", node, _CLASS_QUESTIONS))
                documented.extend(
                    (f"{module}.{node.name}.{method.name}", method, _FUNCTION_QUESTIONS)
                    for method in node.body
                    if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and not method.name.startswith("_")
                )
        for name, node, templates in documented:
            docstring = ast.get_docstring(node)
            if not docstring:
                continue
            paragraphs = _paragraphs(docstring)
            answer = _clip(paragraphs)
            if len(answer) < MIN_ANSWER_CHARS:
                continue
            # Group by the summary paragraph: overrides often repeat it with different details.
            key = paragraphs[0]
            _add(groups, key, False, _Answer(questions=tuple(q.format(name=name) for q in templates), text=answer))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                parameters = ast.unparse(node.args)
                signature = f"{name.rsplit('.', 1)[-1]}({parameters})"
                text = f"The signature is `{signature}`.\n\n{paragraphs[0]}"
                questions = tuple(q.format(name=name) for q in _SIGNATURE_QUESTIONS)
                _add(groups, key, False, _Answer(questions=questions, text=text))
    return list(groups.values())


def _conversation(rng: random.Random, answers: list[_Answer]) -> list[dict]:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
    for turn, answer in enumerate(answers):
        prefix = rng.choice(_FOLLOW_UP_PREFIXES) if turn else ""
        messages.append({"role": "user", "content": prefix + rng.choice(answer.questions)})
        messages.append({"role": "assistant", "content": answer.text})
    return messages


def _split_groups(groups: list[_Group], *, seed: int) -> tuple[list[_Group], list[_Group]]:
    """(train, held-out) groups; held-out mixes reference topics and docstrings."""
    rng = random.Random(f"dialogue-split-{seed}")
    topic_groups = sorted((group for group in groups if group.from_topics), key=lambda group: group.key)
    docstring_groups = sorted((group for group in groups if not group.from_topics), key=lambda group: group.key)
    rng.shuffle(topic_groups)
    rng.shuffle(docstring_groups)
    # A few spare groups cover prompts that `drop_leaked` removes.
    num_topic = round(NUM_HELDOUT_PROMPTS * HELDOUT_TOPIC_FRACTION) + 5
    num_docstring = NUM_HELDOUT_PROMPTS - num_topic + 15
    heldout = topic_groups[:num_topic] + docstring_groups[:num_docstring]
    train = topic_groups[num_topic:] + docstring_groups[num_docstring:]
    return train, heldout


def build_dialogue_corpus(*, seed: int, max_train_chars: int) -> Corpus:
    train_groups, heldout_groups = _split_groups(_topic_groups() + _docstring_groups(), seed=seed)

    rng = random.Random(f"dialogue-train-{seed}")
    units = [answer for group in train_groups for answer in group.answers]
    train: list[str] = []
    seen: set[str] = set()
    total = 0
    for _ in range(NUM_PASSES):
        order = units[:]
        rng.shuffle(order)
        position = 0
        while position < len(order) and total < max_train_chars:
            num_turns = rng.choice((1, 1, 2, 2, 3))
            messages = _conversation(rng, order[position : position + num_turns])
            document = format_chat(messages, add_generation_prompt=False)
            position += num_turns
            # A one-turn chat can come out identical in both passes; keep it once.
            if document not in seen and total + len(document) <= max_train_chars:
                seen.add(document)
                train.append(document)
                total += len(document)

    rng = random.Random(f"dialogue-heldout-{seed}")
    joined = "\0".join(train)
    candidates = []
    for group in heldout_groups:
        answer = rng.choice(group.answers)
        # Different held-out groups can still share text with a training answer (a module docstring
        # that quotes a function's); such a prompt would measure recall, not generalisation.
        if answer.text in joined:
            continue
        messages = _conversation(rng, [answer])[:-1]
        candidates.append(
            HeldoutPrompt(
                domain="dialogue",
                prompt=format_chat(messages, add_generation_prompt=True),
                reference=answer.text + IM_END,
            )
        )
    rng.shuffle(candidates)
    heldout = drop_leaked(candidates, train)[:NUM_HELDOUT_PROMPTS]
    return Corpus(domain="dialogue", train=train, heldout=heldout)

"""The four text domains of the tiny zoo, built deterministically from what CPython 3.11 ships.

| domain     | training text                                   | held-out prompts                        |
|------------|-------------------------------------------------|-----------------------------------------|
| `code`     | stdlib source, function/class-sized chunks      | functions from held-out files           |
| `dialogue` | Q&A chats over `pydoc_data` topics + docstrings | questions on held-out topics/functions  |
| `math`     | generated word problems, worked solutions       | other seeds, plus held-out templates    |
| `agentic`  | generated tool-use traces (`<tool_call>` JSON)  | other seeds; before the call or answer  |

Nothing is downloaded and nothing is random beyond string-seeded `random.Random` streams over sorted
inputs, so two builds with the same `seed` on the same Python give identical corpora. The chat
domains are formatted with `format_chat`; `code` is raw source. Each domain module's docstring lists
its own design choices; `corpus.py` defines what a held-out prompt and reference are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from specd.data.agentic import build_agentic_corpus
from specd.data.corpus import Corpus
from specd.data.dialogue import build_dialogue_corpus
from specd.data.math_problems import build_math_corpus
from specd.data.stdlib_code import build_code_corpus

__all__ = ["DEFAULT_MAX_TRAIN_CHARS", "DOMAINS", "build_corpus", "tokenizer_sample"]

DOMAINS: tuple[str, ...] = ("code", "dialogue", "math", "agentic")

# About 4 MB per domain: more than a tiny model sees in a few CPU minutes, so no document needs to
# repeat, and small enough to build all four in a few seconds.
DEFAULT_MAX_TRAIN_CHARS = 4_000_000

_BUILDERS: dict[str, Callable[..., Corpus]] = {
    "code": build_code_corpus,
    "dialogue": build_dialogue_corpus,
    "math": build_math_corpus,
    "agentic": build_agentic_corpus,
}


def build_corpus(domain: str, *, seed: int = 0, max_train_chars: int | None = None) -> Corpus:
    """Training documents and held-out prompts of one domain.

    `max_train_chars` bounds the total length of the training documents (default
    `DEFAULT_MAX_TRAIN_CHARS`); it does not change the held-out prompts.
    """
    if domain not in _BUILDERS:
        raise ValueError(f"unknown domain {domain!r}; expected one of {DOMAINS}")
    if max_train_chars is None:
        max_train_chars = DEFAULT_MAX_TRAIN_CHARS
    if max_train_chars <= 0:
        raise ValueError(f"max_train_chars must be positive, got {max_train_chars}")
    return _BUILDERS[domain](seed=seed, max_train_chars=max_train_chars)


def tokenizer_sample(corpora: Iterable[Corpus], *, max_chars_per_domain: int = 1_000_000) -> list[str]:
    """Training documents for the tokenizer: an evenly spaced subset of each corpus.

    Equal budgets per domain keep code (long documents) from crowding out the chat formats, and even
    spacing samples the whole corpus rather than its first files or seeds.
    """
    sample: list[str] = []
    for corpus in corpora:
        total_chars = corpus.num_train_chars
        stride = max(1, round(total_chars / max_chars_per_domain)) if total_chars else 1
        budget = max_chars_per_domain
        for document in corpus.train[::stride]:
            if len(document) > budget:
                break
            sample.append(document)
            budget -= len(document)
    return sample

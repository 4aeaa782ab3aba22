"""The corpus contract shared by every domain builder, and its JSON-lines form.

A `Corpus` is plain text: training documents, and held-out prompts paired with the continuation the
corpus itself would have produced. Tokenization and packing happen later, in the trainer.

For chat domains a held-out `prompt` ends with the generation prompt `<|im_start|>assistant\\n` and the
`reference` is the assistant message followed by `<|im_end|>`, so `prompt + reference` is a prefix
of the formatted conversation and the reference ends on the token where generation stops. For code
the prompt is the first lines of a function (signature plus the first docstring line) and the
reference is the rest of it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

__all__ = ["Corpus", "HeldoutPrompt", "drop_leaked", "read_prompts_jsonl", "write_heldout_jsonl"]


@dataclass(kw_only=True, slots=True, frozen=True)
class HeldoutPrompt:
    """A prompt the model never saw in training, with its true continuation."""

    domain: str
    """One of `DOMAINS`."""
    prompt: str
    """Text that ends exactly where the model should continue."""
    reference: str
    """The continuation the source text has after `prompt`."""


@dataclass(kw_only=True, slots=True)
class Corpus:
    """Training documents and held-out prompts of one domain."""

    domain: str
    """One of `DOMAINS`."""
    train: list[str] = field(default_factory=list)
    """Documents as text; the trainer separates them with `<|endoftext|>`."""
    heldout: list[HeldoutPrompt] = field(default_factory=list)
    """Prompts from items (files, topics, seeds) that no training document comes from."""

    @property
    def num_train_chars(self) -> int:
        return sum(len(document) for document in self.train)


def drop_leaked(heldout: list[HeldoutPrompt], train: list[str]) -> list[HeldoutPrompt]:
    """Keep the held-out prompts whose full text is not inside any training document.

    Builders split by item (file, topic, random stream); this catches the coincidences the split
    cannot see, such as the same function copied into two stdlib files.
    """
    # NUL never occurs in our text, so no match can straddle two documents.
    joined = "\0".join(train)
    return [item for item in heldout if item.prompt + item.reference not in joined]


def write_heldout_jsonl(corpus: Corpus, path: str | os.PathLike) -> None:
    """Write one `{"domain", "prompt", "reference"}` object per line."""
    with open(path, "w", encoding="utf-8") as handle:
        for item in corpus.heldout:
            record = {"domain": item.domain, "prompt": item.prompt, "reference": item.reference}
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")


def read_prompts_jsonl(path: str | os.PathLike) -> list[HeldoutPrompt]:
    """Read what `write_heldout_jsonl` wrote (blank lines are skipped)."""
    prompts = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            missing = {"domain", "prompt", "reference"} - record.keys()
            if missing:
                raise ValueError(f"{path}:{line_number}: missing {sorted(missing)}")
            prompts.append(
                HeldoutPrompt(domain=record["domain"], prompt=record["prompt"], reference=record["reference"])
            )
    return prompts

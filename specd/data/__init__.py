"""Corpora and tokenizer for the tiny zoo: four text domains built from CPython's own files and
generators, and a byte-level BPE tokenizer with the chat and tool-call special tokens."""

from specd.data.corpus import (
    Corpus,
    HeldoutPrompt,
    read_prompts_jsonl,
    write_heldout_jsonl,
)
from specd.data.domains import (
    DEFAULT_MAX_TRAIN_CHARS,
    DOMAINS,
    build_corpus,
    tokenizer_sample,
)
from specd.data.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    format_chat,
    load_tokenizer,
    parse_chat,
    save_tokenizer,
    train_tokenizer,
)

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_MAX_TRAIN_CHARS",
    "DOMAINS",
    "SPECIAL_TOKENS",
    "Corpus",
    "HeldoutPrompt",
    "build_corpus",
    "format_chat",
    "load_tokenizer",
    "parse_chat",
    "read_prompts_jsonl",
    "save_tokenizer",
    "tokenizer_sample",
    "train_tokenizer",
    "write_heldout_jsonl",
]

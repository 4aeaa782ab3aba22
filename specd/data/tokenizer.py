"""Byte-level BPE tokenizer and chat format for the tiny zoo.

Design choices:

- **Byte-level BPE** (GPT-2 style: `pre_tokenizers.ByteLevel` with the GPT-2 split regex, no prefix
  space, `decoders.ByteLevel`). Every string, including arbitrary Unicode, encodes without an unknown
  token and decodes back exactly, so there is no `unk_token`. The trainer starts from the full 256-byte
  alphabet so bytes that never occur in the training sample are still representable.
- **Special tokens have fixed ids 0..6**, in the order of `SPECIAL_TOKENS`, because the models, the
  diffusion drafter (`<|mask|>`) and the services refer to them by id. `load_tokenizer` checks this.
- **Stop and separator tokens.** A chat turn ends with `<|im_end|>`, so that is the EOS token that
  generation stops at. `<|endoftext|>` separates packed pre-training documents and is never produced
  inside a chat. `<|pad|>` is a dedicated pad id, so padding can never be confused with a real stop.
  There is no BOS token: the Qwen family runs without one and our prompts start with `<|im_start|>`.
- **`<tool_call>` / `</tool_call>` are added but not special** (as in Qwen2.5): decoding with
  `skip_special_tokens=True` drops control tokens yet keeps the tool-call markup, which clients parse.
- **The chat template is Qwen style**, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message, and
  `<|im_start|>assistant\\n` as the generation prompt. `format_chat` is its pure-Python twin (no
  Jinja at runtime); a unit test checks the two agree through `transformers.AutoTokenizer`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

__all__ = [
    "CHAT_TEMPLATE",
    "ENDOFTEXT",
    "GENERATION_PROMPT",
    "IM_END",
    "IM_START",
    "MASK",
    "PAD",
    "SPECIAL_TOKENS",
    "TOOL_CALL_END",
    "TOOL_CALL_START",
    "format_chat",
    "load_tokenizer",
    "parse_chat",
    "save_tokenizer",
    "train_tokenizer",
]

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PAD = "<|pad|>"

# Order is the id assignment: SPECIAL_TOKENS[i] has id i.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, MASK, TOOL_CALL_START, TOOL_CALL_END, PAD)

# Content tokens: single ids, but kept when decoding with skip_special_tokens=True.
_NON_SPECIAL_ADDED = frozenset({TOOL_CALL_START, TOOL_CALL_END})

GENERATION_PROMPT = f"{IM_START}assistant\n"

# The Jinja twin of `format_chat`. One line, so `trim_blocks`/`lstrip_blocks` cannot change it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_SPECIAL_SPLIT = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
_ROLE = re.compile(r"[a-z_]+")
_TURN = re.compile(r"<\|im_start\|>([a-z_]+)\n(.*?)<\|im_end\|>\n", re.DOTALL)


def format_chat(messages: list[dict], *, add_generation_prompt: bool) -> str:
    """Render `messages` (dicts with "role" and "content") exactly as `CHAT_TEMPLATE` does."""
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        # Anything else would not parse back: roles are lower-case words, contents hold no markers.
        if not _ROLE.fullmatch(role):
            raise ValueError(f"invalid chat role {role!r}")
        if IM_START in content or IM_END in content:
            raise ValueError(f"{role} message contains a chat turn marker")
        parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        parts.append(GENERATION_PROMPT)
    return "".join(parts)


def parse_chat(text: str) -> list[dict]:
    """Inverse of `format_chat`: the messages of a formatted chat.

    A trailing generation prompt (`<|im_start|>assistant\\n` with no content yet) is ignored, so a
    held-out prompt parses to the turns before the one the model must write.
    """
    messages = []
    position = 0
    for match in _TURN.finditer(text):
        if match.start() != position:
            raise ValueError(f"text between chat turns at offset {position}")
        messages.append({"role": match.group(1), "content": match.group(2)})
        position = match.end()
    if text[position:] not in ("", GENERATION_PROMPT):
        raise ValueError(f"unparsed chat tail at offset {position}: {text[position:position + 40]!r}")
    return messages


def train_tokenizer(texts: Iterable[str], *, vocab_size: int = 4096) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts`; special tokens get ids 0..6."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size {vocab_size} cannot hold the byte alphabet and special tokens")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The trainer assigns its special tokens the first ids, in list order.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(_without_special_tokens(texts), trainer=trainer)
    return _mark_tool_call_tokens_non_special(tokenizer)


def _without_special_tokens(texts: Iterable[str]) -> Iterable[str]:
    # The BPE trainer does not split its input on added tokens, so chat-formatted text would spend
    # merges on fragments like "<|" and "im_start"; train on the text between the markers instead.
    for text in texts:
        yield from filter(None, _SPECIAL_SPLIT.split(text))


def _mark_tool_call_tokens_non_special(tokenizer: Tokenizer) -> Tokenizer:
    # The trainer only knows "special" tokens; flip the tool-call markers to plain added tokens in the
    # serialized form, which keeps their ids (re-adding them through the API would not).
    state = json.loads(tokenizer.to_str())
    for entry in state["added_tokens"]:
        if entry["content"] in _NON_SPECIAL_ADDED:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(state))


def _check_special_ids(tokenizer: Tokenizer) -> None:
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        actual_id = tokenizer.token_to_id(token)
        if actual_id != expected_id:
            raise ValueError(f"special token {token} has id {actual_id}, expected {expected_id}")


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` so `AutoTokenizer.from_pretrained` loads it."""
    _check_special_ids(tokenizer)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "mask_token": MASK,
        "additional_special_tokens": [ENDOFTEXT, IM_START],
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte-level decoding is already exact; the legacy clean-up would eat spaces before punctuation.
        "clean_up_tokenization_spaces": False,
        # Decoder-only batched generation pads on the left so every prompt ends at the last column.
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2, ensure_ascii=False)
        handle.write("\n")


def load_tokenizer(directory: str | os.PathLike, *, zoo: bool = False) -> Tokenizer:
    """Load `tokenizer.json` from `directory` (any checkpoint's; ``zoo``: also check it has the tiny
    zoo's special-token ids, which its models and drafters refer to by number)."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no tokenizer.json: point at a model directory that has one "
                                f"(a zoo model, or a Hugging Face checkpoint), or pass token ids instead of text")
    tokenizer = Tokenizer.from_file(str(path))
    if zoo:
        _check_special_ids(tokenizer)
    return tokenizer

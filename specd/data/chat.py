"""A model's own chat template, rendered the way `transformers` renders it.

The tiny zoo's format is fixed (`specd.data.tokenizer.format_chat`), but a real checkpoint brings
its own template in ``tokenizer_config.json``: SmolLM2's, for one, opens every conversation that has
no system turn with a default system message. Serving must render exactly what the model was
trained on, so `ChatTemplate` runs the checkpoint's Jinja source, as vLLM and transformers do.

Design choices:

- **transformers' Jinja settings**: a sandboxed environment (a template is data from a model
  directory, not code we trust), ``trim_blocks`` and ``lstrip_blocks``, and the ``raise_exception``
  helper templates call to refuse a conversation. A template that raises is a 400 for the caller
  (`ValueError`), never a crash.
- **No turn markers inside a message.** A content holding a special token the template itself writes
  (``<|im_start|>``, ``<|im_end|>``) would let a user forge turns; it is refused with the token named,
  as `format_chat` refuses the zoo's markers. Other special tokens (SmolLM2's ``<filename>``, the
  zoo's ``<tool_call>``) are content and pass.
- **Without a template**, the zoo's format (`format_chat`): the tiny models have no other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specd.data.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, parse_chat

__all__ = ["ChatTemplate"]


def _raise(message: str) -> None:
    raise ValueError(message)


class ChatTemplate:
    """Renders a list of ``{"role", "content"}`` messages into the prompt text a model expects."""

    def __init__(self, source: str = CHAT_TEMPLATE, special_tokens: Iterable[str] = (IM_START, IM_END)) -> None:
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        environment.globals["raise_exception"] = _raise
        try:
            self.template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not parse (line {error.lineno}: {error.message})") from error
        self.source = source
        # The markers: special tokens the template writes. Longest first, so an error names the
        # whole token and not a prefix of it.
        self.markers = tuple(sorted({t for t in special_tokens if t and t in source}, key=len, reverse=True))

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> ChatTemplate:
        """The template of a model directory: ``tokenizer_config.json``'s ``chat_template`` and the
        tokenizer's special tokens; the zoo's format when it names no template."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = config.get("chat_template") or CHAT_TEMPLATE
        if isinstance(source, list):  # the named-templates form: [{"name": "default", "template": ...}]
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default") or CHAT_TEMPLATE
        special = {IM_START, IM_END}
        tokenizer_path = directory / "tokenizer.json"
        if tokenizer_path.is_file():
            added = json.loads(tokenizer_path.read_text(encoding="utf-8")).get("added_tokens", [])
            special |= {entry["content"] for entry in added if entry.get("special")}
        return cls(source, special)

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text; ValueError (naming what is wrong) for a message the template or the
        marker check refuses."""
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, str):
                raise ValueError(f"message {i} has no text content")
            for token in self.markers:
                if token in content:
                    raise ValueError(f"{message.get('role', 'a')} message contains the chat turn marker {token!r}: "
                                     "remove it from the message content")
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template refused the conversation: {error}") from error


def render_prompt(text: str, template: ChatTemplate) -> str:
    """A zoo prompt in a model's own format: a chat (the zoo's turn markup) re-rendered with
    ``template`` (SmolLM2's adds its system turn), any other text (a code head) as it is."""
    try:
        messages = parse_chat(text)
    except ValueError:
        return text
    return template.render(messages) if messages else text

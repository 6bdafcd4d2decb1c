"""A request's prompt token IDs, computed the way the engine computes them.

Needed where exact block boundaries matter: matching a prompt against the blocks an
engine reports holding (``kv_events``). A chat request's prompt is the model's chat
template rendered over its messages (and tools) with the generation prompt appended,
then tokenized without adding special tokens (the template has them); a completion's
prompt is its text, tokenized with them. The template comes from the
``tokenizer_config.json`` next to ``sizing.tokenizer`` — the file engines load — and is
rendered the way Hugging Face's ``apply_chat_template`` does (a sandboxed Jinja
environment, ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``). Rendering is
bounded by the request's own size limit; a template that fails for a request only means
that request is matched approximately.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .tokens import encode

MAX_PROMPT_TOKENS = 1_000_000


class TemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def content_format(env: jinja2.Environment, template: str) -> str:
    """``openai`` when the template loops over a message's content (it expects a list of
    parts), else ``string``: how vLLM decides what shape of content to render with (it
    then turns every string content into ``[{"type": "text", "text": ...}]``)."""
    ast = env.parse(template)
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, jinja2.nodes.Filter | jinja2.nodes.Test) and it.node is not None:
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return "openai"
        if (isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"):
            return "openai"
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return "openai"
    return "string"


class PromptIds:
    """Prompt token IDs for requests, from a tokenizer and its chat template."""

    __slots__ = ("tokenizer", "template", "specials", "parts")

    def __init__(self, tokenizer: Any, template: str, specials: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            undefined=jinja2.Undefined)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.tokenizer = tokenizer
        self.template = env.from_string(template)
        self.specials = specials
        self.parts = content_format(env, template) == "openai"

    @classmethod
    def load(cls, tokenizer: Any, tokenizer_path: str) -> PromptIds | None:
        """From the ``tokenizer_config.json`` beside the tokenizer file; None when it has
        no chat template (chat prompts cannot be computed then)."""
        cfg_path = Path(tokenizer_path).with_name("tokenizer_config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            return None
        template = cfg.get("chat_template") if isinstance(cfg, dict) else None
        if not isinstance(template, str):
            return None
        specials = {k: v for k, v in cfg.items()
                    if k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    and isinstance(v, str)}
        return cls(tokenizer, template, specials)

    def ids(self, body: dict[str, Any], chat: bool) -> list[int] | None:
        """The prompt's token IDs, or None when they cannot be computed here (token-ID
        prompts, several prompts, content parts other than text, a template error)."""
        if not chat:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            return self._encode(prompt, True)
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("content", ""), str | None):
                return None
        if self.parts:
            messages = [m | {"content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        try:
            text = self.template.render(
                messages=messages, tools=body.get("tools"), add_generation_prompt=True,
                **self.specials)
        except (jinja2.TemplateError, TemplateError, TypeError, ValueError):
            return None
        return self._encode(text, False)

    def _encode(self, text: str, special: bool) -> list[int] | None:
        ids = encode(self.tokenizer, text, special)
        return ids if len(ids) <= MAX_PROMPT_TOKENS else None

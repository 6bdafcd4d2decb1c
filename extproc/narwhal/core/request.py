"""Client request validation and the upstream rewrite.

Narwhal validates only the fields it interprets; everything else is the
engine's business and is forwarded exactly as sent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from .errors import invalid_request, model_not_found, sampling_width

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
COMPLETION_PATHS = frozenset({CHAT_PATH, COMPLETIONS_PATH})
TOOL_CHOICE_WORDS = frozenset({"none", "auto", "required"})
MAX_DEPTH = 254  # orjson's serialisation limit
# orjson reads an integer past 64 bits as a float: 2**64 would reach the engine as
# 1.8446744073709552e+19 (vLLM then refuses another value than the client sent). Any
# such literal has 19 digits or more; a body with a run that long (in a string too:
# a false alarm only costs the exact path) is re-read and re-written by the standard
# library, whose integers are exact.
# Found as a run of 19 zeros in the body with every digit made a zero and every other
# byte a space: two C loops, 7-12x faster than the regex [0-9]{19} (measured: 2.6 against
# 32 us for a 2 KB body, 0.7 against 8.5 ms for 1 MiB), on every request's bytes.
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_WIDE_RUN = b"0" * 19


def _wide_integer(raw: bytes) -> bool:
    """Whether ``raw`` has a run of 19 digits or more: an integer orjson may not keep."""
    return raw.translate(_DIGITS_AS_ZERO).find(_WIDE_RUN) >= 0


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A validated completion request and the facts the router acts on."""

    chat: bool
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_bytes: int
    max_tokens: int | None
    # vLLM 0.32 cannot return token IDs together with these: with ``return_token_ids`` it
    # drops an echoed prompt, and under a tool or reasoning parser ``include_reasoning:
    # false`` nulls every event's IDs. Such requests are metered from the engine's usage.
    ids_compatible: bool = True
    # The client's bytes, kept only when they may hold an integer orjson cannot keep
    # exact (``_wide_integer``): the upstream body is then written from them.
    wide: bytes | None = None

    def without_body(self) -> CompletionRequest:
        """This request as read once its body is on its way (or parked as the client's
        bytes): its facts and its model. Parsed, a body takes up to ten times its bytes
        (measured: 1 MiB of small messages, 9.8 MiB; of a token-ID prompt, 6.3 MiB), which
        a thousand requests held through their responses would multiply. (Made directly:
        ``dataclasses.replace`` took 2.4 us, this 1.1.)"""
        return CompletionRequest(
            chat=self.chat, body={"model": str(self.body.get("model", ""))},
            stream=self.stream, include_usage=self.include_usage,
            return_token_ids=self.return_token_ids, prompt_bytes=self.prompt_bytes,
            max_tokens=self.max_tokens, ids_compatible=self.ids_compatible)

    def prompt_text(self) -> str:
        """The prompt's text parts, for a tokenizer (token-ID prompts have none)."""
        if self.chat:
            parts: list[str] = []
            for m in self.body["messages"]:
                content = m.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    parts.extend(p["text"] for p in content if isinstance(p.get("text"), str))
            return "\n".join(parts)
        prompt = self.body["prompt"]
        if isinstance(prompt, str):
            return prompt
        return prompt[0] if prompt and isinstance(prompt[0], str) else ""


def _as_int(v: Any) -> int | None:
    """An integer field's value as vLLM's validation reads it: an integer, or a float
    with nothing after the point (``2.0`` is 2; ``1.5`` and Booleans are not integers)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return None


def _opt_bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    v = body.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid_request(f"'{param or key}' must be a boolean", param or key)
    return v


def _opt_positive_int(body: dict[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    n = _as_int(v)
    if n is None or n < 1:
        raise invalid_request(f"'{key}' must be a positive integer", key)
    return n


def _messages_bytes(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise invalid_request("'messages' must be a non-empty array of message objects", "messages")
    total = 0
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid_request(f"'{param}' must be an object", param)
        if not isinstance(m.get("role"), str):
            raise invalid_request(f"'{param}.role' must be a string", f"{param}.role")
        content = m.get("content")
        if isinstance(content, str):
            total += len(content.encode())
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise invalid_request(f"'{param}.content[{j}]' must be a typed content part",
                                          f"{param}.content[{j}]")
                text = part.get("text")
                if isinstance(text, str):
                    total += len(text.encode())
                elif part["type"] == "text":  # sized, indexed and templated as text
                    raise invalid_request(f"'{param}.content[{j}].text' must be a string",
                                          f"{param}.content[{j}].text")
        elif content is not None:
            raise invalid_request(f"'{param}.content' must be a string, an array or null",
                                  f"{param}.content")
    return total


def _token_ids(prompt: list[Any]) -> bool:
    return bool(prompt) and all(type(p) is int and p >= 0 for p in prompt)  # not Booleans


def _prompt_bytes(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt.encode())
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            if len(prompt) > 1:
                raise sampling_width("prompt", len(prompt))
            return len(prompt[0].encode())
        if _token_ids(prompt):
            return 4 * len(prompt)
        if all(isinstance(p, list) for p in prompt):
            if len(prompt) > 1:
                raise sampling_width("prompt", len(prompt))
            # one prompt of token IDs sent as a batch of one (vLLM takes it as the flat
            # array; evaluation harnesses send it so)
            if _token_ids(prompt[0]):
                return 4 * len(prompt[0])
            raise invalid_request("'prompt' token arrays must hold non-negative integers",
                                  "prompt")
    raise invalid_request("'prompt' must be a string or an array of token IDs", "prompt")


def _check_tools(body: dict[str, Any], stream: bool) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid_request("'tools' must be an array", "tools")
        for i, tool in enumerate(tools):
            param = f"tools[{i}]"
            if not isinstance(tool, dict) or not isinstance(tool.get("type"), str):
                raise invalid_request(f"'{param}' must be an object with a type", param)
            if tool["type"] != "function":
                if not stream:
                    raise invalid_request(
                        f"Tool type '{tool['type']}' is not supported for non-streaming requests",
                        f"{param}.type")
                continue
            fn = tool.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise invalid_request(f"'{param}.function.name' must be a non-empty string",
                                      f"{param}.function.name")
    choice = body.get("tool_choice")
    if choice is None or (isinstance(choice, str) and choice in TOOL_CHOICE_WORDS):
        return
    if isinstance(choice, dict) and isinstance(choice.get("type"), str):
        if choice["type"] == "function":
            fn = choice.get("function")
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                return
            raise invalid_request("'tool_choice.function.name' must be a string",
                                  "tool_choice.function.name")
        if not stream:
            raise invalid_request(
                f"tool_choice type '{choice['type']}' is not supported for non-streaming requests",
                "tool_choice")
        return
    raise invalid_request("'tool_choice' must be none, auto, required or a function choice",
                          "tool_choice")


def _check_modalities(body: dict[str, Any], stream: bool) -> None:
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list) or not all(isinstance(m, str) for m in modalities):
            raise invalid_request("'modalities' must be an array of strings", "modalities")
        other = [m for m in modalities if m != "text"]
        if other and not stream:
            raise invalid_request(
                f"Output modality '{other[0]}' is not supported for non-streaming requests",
                "modalities")
    audio = body.get("audio")
    if audio is not None:
        if not isinstance(audio, dict):
            raise invalid_request("'audio' must be an object", "audio")
        if not stream:
            raise invalid_request("Audio output is not supported for non-streaming requests",
                                  "audio")


def parse_request(path: str, raw: bytes, model: str) -> CompletionRequest:
    """Validate a completion body; raise :class:`HttpError` with the seed's status."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise invalid_request(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid_request("Request body must be a JSON object")
    try:
        # The body goes upstream re-serialised; orjson writes at most 254 levels of nesting
        # but reads up to 1024. Found here, a too-deep body is this request's 400, not a
        # failure later inside another request's queue wake-up.
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        raise invalid_request(f"Request body nests deeper than {MAX_DEPTH} levels") from None
    chat = path == CHAT_PATH
    requested = body.get("model")
    if requested is not None:
        if not isinstance(requested, str):
            raise invalid_request("'model' must be a string", "model")
        if requested != model:
            raise model_not_found(requested)
    if chat:
        if "prompt" in body and "messages" not in body:
            raise invalid_request("Chat completions take 'messages', not 'prompt'", "messages")
        prompt_bytes = _messages_bytes(body.get("messages"))
    else:
        if "prompt" not in body:
            raise invalid_request("'prompt' is required", "prompt")
        prompt_bytes = _prompt_bytes(body["prompt"])
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise invalid_request("'stream_options' must be an object", "stream_options")
        include_usage = _opt_bool(options, "include_usage", "stream_options.include_usage")
        # vLLM's own rule (an empty object passes); Narwhal streams from the engine
        # either way, so without it the engine would never see what the client sent
        if options and not stream:
            raise invalid_request("Stream options can only be defined when `stream=True`.",
                                  "stream_options")
    prompt_logprobs = _as_int(body.get("prompt_logprobs"))
    if not stream and prompt_logprobs is not None and (prompt_logprobs > 0
                                                       or prompt_logprobs == -1):
        # vLLM computes them only for a non-streaming request, and Narwhal always asks
        # the engine for a stream (it would answer "not available when stream=True")
        raise invalid_request("'prompt_logprobs' is not supported for non-streaming requests: "
                              "Narwhal assembles the response from the engine's stream, "
                              "which does not carry them", "prompt_logprobs")
    for key in ("n", "best_of"):
        width = _opt_positive_int(body, key)
        if width is not None and width > 1:
            raise sampling_width(key, width)
    max_tokens = _opt_positive_int(body, "max_tokens")
    max_completion = _opt_positive_int(body, "max_completion_tokens")
    return_ids = _opt_bool(body, "return_token_ids")
    echo = _opt_bool(body, "echo")
    include_reasoning = body.get("include_reasoning", True)
    if not isinstance(include_reasoning, bool):
        raise invalid_request("'include_reasoning' must be a boolean", "include_reasoning")
    if chat:
        _check_tools(body, stream)
        _check_modalities(body, stream)
    return CompletionRequest(
        chat=chat, body=body, stream=stream, include_usage=include_usage,
        return_token_ids=return_ids, prompt_bytes=prompt_bytes,
        max_tokens=max_completion if max_completion is not None else max_tokens,
        ids_compatible=not echo and include_reasoning,
        wide=raw if _wide_integer(raw) else None,
    )


def upstream_body(req: CompletionRequest, token_ids: bool) -> bytes:
    """The engine-bound body: always a usage-reporting stream, IDs where the dialect has them
    (``token_ids``: the engine's dialect supplies them and the request allows them)."""
    body = dict(req.body) if req.wide is None else json.loads(req.wide)
    body["stream"] = True
    options = body.get("stream_options")
    body["stream_options"] = (dict(options) if isinstance(options, dict) else {}) | {
        "include_usage": True}
    if token_ids:
        body["return_token_ids"] = True
        body["stream_interval"] = 1
    if req.wide is None:
        return orjson.dumps(body)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()



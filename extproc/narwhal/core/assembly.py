"""Non-streaming assembly: one final response from the engine's event stream.

The seed's assembly table is implemented field by field. Anything the engine sends
that Narwhal cannot faithfully fold into a non-streaming response (audio,
annotations, custom tool output, unknown fields with a value, malformed supported
fields) is an :class:`EngineOutputError`, which the exchange turns into a 502.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from . import jsontext
from .jsontext import JsonArray
from .meter import EngineOutputError
from .pieces import TextPieces
from .prefix import REPLY_MAX_BYTES

_T = TypeVar("_T")

STRING_DELTAS = ("content", "reasoning", "reasoning_content", "refusal")
CHAT_CHOICE_KEYS = frozenset({"index", "delta", "logprobs", "finish_reason", "stop_reason",
                              "token_ids"})
TEXT_CHOICE_KEYS = frozenset({"index", "text", "logprobs", "finish_reason", "stop_reason",
                              "token_ids", "prompt_logprobs", "prompt_token_ids"})
DELTA_KEYS = frozenset({"role", "content", "reasoning", "reasoning_content", "refusal",
                        "tool_calls", "function_call", "token_ids"})
TOOL_CALL_KEYS = frozenset({"index", "id", "type", "function"})
FUNCTION_KEYS = frozenset({"name", "arguments"})
TEXT_LOGPROB_KEYS = ("tokens", "token_logprobs", "text_offset", "top_logprobs")
# Top-level keys the assembler rebuilds itself rather than copying as metadata.
REBUILT = frozenset({"choices", "usage", "object", "prompt_token_ids"})
# What an assembly may hold apart from its text: each new choice, tool call or metadata
# field is a Python object of several hundred bytes made from a few bytes of an event, so
# that without a count an engine's 16 MiB (serving.max_response_bytes) of events, each
# naming a new one, held ~75 MB per request (measured: 200,000 one-token events with a
# new choice index each, 28.7 MB of events, held 132 MB). Narwhal refuses n > 1 and
# batched prompts, so a real response has one choice; a few parallel tool calls; a
# handful of metadata fields.
MAX_CHOICES = 128
MAX_TOOL_CALLS = 128  # per choice
MAX_METADATA = 256  # top-level fields kept from the events
# ... and each is counted in ``held`` at what its objects take (``tracemalloc``, with their
# place in their table): within those bounds an engine's events naming a new choice and
# tool call each held 8.2 MB a response, counted 0.05 (16,384 tool calls from 1.9 MB).
CHOICE_HELD = 650
TOOL_CALL_HELD = 625  # with its id, name and arguments' TextPieces
PIECES_HELD = 235  # a choice's content, reasoning or refusal


def _has_value(v: Any) -> bool:
    return v is not None and v != [] and v != {} and v != ""


def _bad(what: str) -> EngineOutputError:
    return EngineOutputError(f"malformed engine output: {what}")


def _unsupported(what: str) -> EngineOutputError:
    return EngineOutputError(f"unsupported engine output for a non-streaming response: {what}")


def _only_known(fields: dict[str, Any], known: frozenset[str], what: str) -> None:
    """Refuse a field outside ``known`` that carries a value (one without is no output).
    Runs per event: the keys are checked as a set first, and walked only if one is new."""
    if fields.keys() <= known:
        return
    for key, value in fields.items():
        if key not in known and _has_value(value):
            raise _unsupported(f"{what} field '{key}'")


def _hold(hold: Callable[[Any], _T], value: Any) -> _T:
    """``hold(value)``, a ``jsontext`` writer or keeper: orjson reads 1,024 levels of
    nesting and writes 254, so output nested between them is malformed when it comes,
    not a failure at the response's end."""
    try:
        return hold(value)
    except TypeError:
        raise _bad("nested deeper than 254 levels") from None


def _join_repeat_aware(parts: TextPieces, frag: str) -> int:
    """Concatenate, except that a fragment repeating the whole value so far is a repeat
    (some engines resend a call's id and name). The value is joined only when a fragment
    is as long as it: linear overall. Returns the change in bytes held."""
    if parts and len(frag) == parts.size and frag == parts.text():
        return 0
    return parts.add(frag)


@dataclass(slots=True)
class _ToolCall:
    id: TextPieces = field(default_factory=TextPieces)
    name: TextPieces = field(default_factory=TextPieces)
    arguments: TextPieces = field(default_factory=TextPieces)


@dataclass(slots=True)
class _Choice:
    strings: dict[str, TextPieces] = field(default_factory=dict)
    text: TextPieces = field(default_factory=TextPieces)
    tools: dict[int, _ToolCall] = field(default_factory=dict)
    function: _ToolCall | None = None
    lp_content: JsonArray | None = None
    lp_refusal: JsonArray | None = None
    lp_text: dict[str, JsonArray] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None
    has_stop_reason: bool = False
    token_ids: JsonArray = field(default_factory=JsonArray)
    prompt_token_ids: orjson.Fragment | None = None  # completions: vLLM sends them per choice


class Assembler:
    def __init__(self, chat: bool, expose_ids: bool) -> None:
        self.chat = chat
        self.expose_ids = expose_ids
        self.meta: dict[str, Any] = {}
        # The top-level keys an event may carry with nothing new to keep: those rebuilt
        # and those kept already. An event of only these (every event after the first,
        # as engines send them) skips the walk of its fields, with a C-level subset test.
        self.settled = REBUILT
        self.choices: dict[int, _Choice] = {}
        self.prompt_token_ids: orjson.Fragment | None = None
        self.prompt_ids_seen = False
        # About the bytes it holds (text, JSON text, tool call fragments): what the exchange
        # counts against serving.max_held_bytes.
        self.held = 0

    # -- feeding ---------------------------------------------------------------
    def feed(self, event: dict[str, Any]) -> None:
        if not event.keys() <= self.settled:
            meta = self.meta
            for key, value in event.items():
                if key not in REBUILT and key not in meta and value is not None:
                    if len(meta) >= MAX_METADATA:
                        raise _unsupported(f"more than {MAX_METADATA} top-level fields")
                    meta[key] = self._keep(jsontext.held, value)
            self.settled = REBUILT.union(meta)
        ptids = event.get("prompt_token_ids")
        if ptids is not None and not self.prompt_ids_seen:
            if ptids.__class__ is not list:
                raise _bad("prompt_token_ids is not an array")
            self.prompt_ids_seen = True
            if self.expose_ids and self.chat:
                self.prompt_token_ids = self._keep(jsontext.kept, ptids)
        for choice in event["choices"]:
            index = choice.get("index", 0)
            if index.__class__ is not int or index < 0:
                raise _bad("choice index is not a non-negative integer")
            state = self.choices.get(index)
            if state is None:
                if len(self.choices) >= MAX_CHOICES:
                    raise _unsupported(f"more than {MAX_CHOICES} choices")
                state = self.choices[index] = _Choice()
                self.held += CHOICE_HELD
            if self.chat:
                self._chat_choice(state, choice)
            else:
                self._text_choice(state, choice)
            self._common(state, choice)

    def _common(self, state: _Choice, choice: dict[str, Any]) -> None:
        fr = choice.get("finish_reason")
        if fr is not None:
            if not isinstance(fr, str):
                raise _bad("finish_reason is not a string")
            state.finish_reason = fr
            if "stop_reason" in choice:
                state.has_stop_reason = True
                state.stop_reason = self._keep(jsontext.held, choice["stop_reason"])
        elif choice.get("stop_reason") is not None:
            state.has_stop_reason = True
            state.stop_reason = self._keep(jsontext.held, choice["stop_reason"])
        if self.expose_ids:
            ids = choice.get("token_ids")
            if ids:
                if ids.__class__ is not list:
                    raise _bad("token_ids is not an array")  # engines without ID checks
                self.held += _hold(state.token_ids.extend, ids)
            ptids = choice.get("prompt_token_ids")
            if ptids is not None and state.prompt_token_ids is None:
                if ptids.__class__ is not list:
                    raise _bad("prompt_token_ids is not an array")
                state.prompt_token_ids = self._keep(jsontext.kept, ptids)

    def _chat_choice(self, state: _Choice, choice: dict[str, Any]) -> None:
        _only_known(choice, CHAT_CHOICE_KEYS, "choice")
        delta = choice.get("delta")
        if delta is None:
            delta = {}
        elif not isinstance(delta, dict):
            raise _bad("delta is not an object")
        for key, value in delta.items():
            if value is None:
                continue
            if key in STRING_DELTAS:
                if not isinstance(value, str):
                    raise _bad(f"delta.{key} is not a string")
                pieces = state.strings.get(key)
                if pieces is None:
                    pieces = state.strings[key] = TextPieces()
                    self.held += PIECES_HELD
                self.held += pieces.add(value)
            elif key == "tool_calls":
                self._tool_calls(state, value)
            elif key == "function_call":
                self._function_call(state, value)
            elif key == "role":
                if not isinstance(value, str):
                    raise _bad("delta.role is not a string")
            elif key not in DELTA_KEYS and _has_value(value):
                raise _unsupported(f"delta field '{key}'")
        lp = choice.get("logprobs")
        if lp is not None:
            if not isinstance(lp, dict):
                raise _bad("chat logprobs is not an object")
            for key in lp:
                if key not in ("content", "refusal") and _has_value(lp[key]):
                    raise _unsupported(f"logprobs field '{key}'")
            for key, attr in (("content", "lp_content"), ("refusal", "lp_refusal")):
                part = lp.get(key)
                if part is None:
                    continue
                if not isinstance(part, list):
                    raise _bad(f"logprobs.{key} is not an array")
                cur = getattr(state, attr)
                if cur is None:
                    cur = JsonArray()
                    setattr(state, attr, cur)
                self.held += _hold(cur.extend, part)

    def _tool_calls(self, state: _Choice, calls: Any) -> None:
        if not isinstance(calls, list):
            raise _bad("delta.tool_calls is not an array")
        for call in calls:
            if not isinstance(call, dict):
                raise _bad("tool call is not an object")
            _only_known(call, TOOL_CALL_KEYS, "tool call")
            index = call.get("index")
            if index.__class__ is not int or index < 0:
                raise _bad("tool call index is not a non-negative integer")
            kind = call.get("type")
            if kind is not None and kind != "function":
                raise _unsupported(f"tool call type '{kind}'")
            tc = state.tools.get(index)
            if tc is None:
                if len(state.tools) >= MAX_TOOL_CALLS:
                    raise _unsupported(f"more than {MAX_TOOL_CALLS} tool calls in a choice")
                tc = state.tools[index] = _ToolCall()
                self.held += TOOL_CALL_HELD
            cid = call.get("id")
            if cid is not None:
                if not isinstance(cid, str):
                    raise _bad("tool call id is not a string")
                self.held += _join_repeat_aware(tc.id, cid)
            fn = call.get("function")
            if fn is not None:
                self._fragments(tc, fn, "tool call function")

    def _function_call(self, state: _Choice, fn: Any) -> None:
        if state.function is None:
            state.function = _ToolCall()
            self.held += TOOL_CALL_HELD
        self._fragments(state.function, fn, "function_call")

    def _fragments(self, tc: _ToolCall, fn: Any, what: str) -> None:
        if not isinstance(fn, dict):
            raise _bad(f"{what} is not an object")
        _only_known(fn, FUNCTION_KEYS, what)
        name = fn.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise _bad(f"{what} name is not a string")
            self.held += _join_repeat_aware(tc.name, name)
        args = fn.get("arguments")
        if args is not None:
            if not isinstance(args, str):
                raise _bad(f"{what} arguments is not a string")
            self.held += tc.arguments.add(args)

    def _text_choice(self, state: _Choice, choice: dict[str, Any]) -> None:
        _only_known(choice, TEXT_CHOICE_KEYS, "choice")
        text = choice.get("text")
        if text is not None:
            if not isinstance(text, str):
                raise _bad("choice text is not a string")
            self.held += state.text.add(text)
        lp = choice.get("logprobs")
        if lp is None:
            return
        if not isinstance(lp, dict):
            raise _bad("completion logprobs is not an object")
        if state.lp_text is None:
            state.lp_text = {k: JsonArray() for k in TEXT_LOGPROB_KEYS}
        for key in TEXT_LOGPROB_KEYS:
            part = lp.get(key)
            if part is None:
                continue
            if not isinstance(part, list):
                raise _bad(f"logprobs.{key} is not an array")
            self.held += _hold(state.lp_text[key].extend, part)

    def _keep(self, keep: Callable[[Any], tuple[_T, int]], value: Any) -> _T:
        """``value`` as a ``jsontext`` keeper holds it, its size counted in ``held``."""
        kept, size = _hold(keep, value)
        self.held += size
        return kept

    # -- result ----------------------------------------------------------------
    def reply(self) -> str:
        """The first choice's text (a chat's content): what the prefix index learns of a
        non-streaming response, as ``ReplyText`` collects it from a stream's events."""
        state = self.choices.get(0)
        if state is None:
            return ""
        pieces = state.strings.get("content") if self.chat else state.text
        return pieces.text()[:REPLY_MAX_BYTES] if pieces else ""

    def body(self, usage: dict[str, Any]) -> bytes:
        """The assembled response as JSON; ``usage`` is the engine's, or one Narwhal computed."""
        return _hold(jsontext.text, self._result(usage))

    def _result(self, usage: dict[str, Any]) -> dict[str, Any]:
        if not self.choices:
            raise _bad("engine stream ended without any choice")
        choices = []
        for index in sorted(self.choices):
            state = self.choices[index]
            if state.finish_reason is None:
                raise _bad(f"engine stream ended without a finish_reason for choice {index}")
            choices.append(self._chat_result(index, state) if self.chat
                           else self._text_result(index, state))
        resp: dict[str, Any] = {}
        resp["id"] = self.meta.get("id")
        resp["object"] = "chat.completion" if self.chat else "text_completion"
        resp.update({k: v for k, v in self.meta.items() if k != "id"})
        resp["choices"] = choices
        resp["usage"] = usage
        if self.expose_ids and self.prompt_token_ids is not None and self.chat:
            resp["prompt_token_ids"] = self.prompt_token_ids
        return resp

    def _tail(self, out: dict[str, Any], state: _Choice) -> dict[str, Any]:
        out["finish_reason"] = state.finish_reason
        if state.has_stop_reason:
            out["stop_reason"] = state.stop_reason
        if self.expose_ids:
            out["token_ids"] = state.token_ids.fragment()
        return out

    def _chat_result(self, index: int, state: _Choice) -> dict[str, Any]:
        s = state.strings
        # Engines open every stream with ``content: ""``; nothing generated is null, except
        # beside tool calls, where vLLM answers ``""``.
        content = s["content"].text() if "content" in s else ""
        content = content or ("" if state.tools else None)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        for key in ("reasoning", "reasoning_content"):
            if key in s:
                msg[key] = s[key].text()
        msg["refusal"] = s["refusal"].text() if "refusal" in s else None
        if state.tools:
            calls = []
            for i in sorted(state.tools):
                tc = state.tools[i]
                if not tc.id or not tc.name:
                    raise _bad(f"tool call {i} has no {'id' if not tc.id else 'function name'}")
                calls.append({"id": tc.id.text(), "type": "function",
                              "function": {"name": tc.name.text(),
                                           "arguments": tc.arguments.text()}})
            msg["tool_calls"] = calls
        if state.function is not None:
            if not state.function.name:
                raise _bad("function_call has no name")
            msg["function_call"] = {"name": state.function.name.text(),
                                    "arguments": state.function.arguments.text()}
        logprobs = None
        if state.lp_content is not None or state.lp_refusal is not None:
            # vLLM's shape: no refusal key unless used
            logprobs = {"content": None if state.lp_content is None
                        else state.lp_content.fragment()}
            if state.lp_refusal is not None:
                logprobs["refusal"] = state.lp_refusal.fragment()
        return self._tail({"index": index, "message": msg, "logprobs": logprobs}, state)

    def _text_result(self, index: int, state: _Choice) -> dict[str, Any]:
        lp = state.lp_text
        out = self._tail({"index": index, "text": state.text.text(),
                          "logprobs": None if lp is None else
                          {k: v.fragment() for k, v in lp.items()}}, state)
        if self.expose_ids:
            out["prompt_token_ids"] = state.prompt_token_ids
        return out

"""Deterministic output generation in vLLM's OpenAI wire format, without I/O.

The simulator must be faithful to vLLM's wire shape (that is what Narwhal parses in
production) and deterministic per ``seed`` (tests compare streaming against
non-streaming output), so generation is a pure function of the request, the
simulator's options and the fault header.
"""

from __future__ import annotations

import random
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

VOCAB = tuple(
    "the quick brown fox jumps over lazy dog narwhal tusk ocean arctic ice whale pod "
    "swim deep cold water light wave router engine token prefill decode budget queue "
    "admit place stream chunk event model pool latency fast slow calm blue green red "
    "north south east west sun moon star cloud rain snow wind river stone tree leaf"
    .split()
)
TOKEN_ID_BASE = 1000
FAULTS = frozenset(
    {
        "omit-token-ids",
        "bool-token-id",
        "malformed-token-ids",
        "audio",
        "annotations",
        "error-event",
        "abrupt-close",
        "slow-start",
        "omit-usage",
    }
)
OUTPUTS = frozenset({"refusal", "function-call", "multi-tool"})
DIALECTS = frozenset({"vllm", "openai"})
REASONING_MODES = frozenset({"none", "reasoning", "reasoning_content", "both"})


class SimRequestError(ValueError):
    """A request the simulated engine refuses, as vLLM would with a 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SimOptions:
    model: str = "narwhal-sim"
    dialect: str = "vllm"
    reasoning: str = "none"


@dataclass(slots=True)
class Plan:
    """What one request will produce: the engine decides this before it 'runs'."""

    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_tokens: int
    prompt_token_ids: list[int]
    n: int
    max_tokens: int | None
    seed: int
    fault: str | None
    output: str | None
    tool_names: list[str]
    logprobs: bool
    top_logprobs: int
    stop: str | None
    request_id: str
    created: int
    model: str
    dialect: str
    reasoning: str
    # Per-choice token plans: list of (kind, token_index) where kind is one of
    # "reasoning", "content", "refusal", ("tool", call_no), "function".
    choices: list[list[tuple[Any, int]]] = field(default_factory=list)


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        parts: list[str] = []
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        return " ".join(str(p) for p in prompt)
    return str(prompt)


def count_prompt_tokens(text: str) -> int:
    """A 4-bytes-per-token tokenizer: crude, but stable, so routers can learn the ratio."""
    return max(1, (len(text.encode()) + 3) // 4)


def make_plan(body: dict[str, Any], opts: SimOptions, fault: str | None, output: str | None) -> Plan:
    chat = "messages" in body
    if not chat and "prompt" not in body:
        raise SimRequestError("either messages or prompt is required", "messages")
    if body.get("model") not in (None, opts.model):
        raise SimRequestError(f"The model `{body.get('model')}` does not exist.", "model")
    text = prompt_text(body)
    prompt_tokens = count_prompt_tokens(text)
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = zlib.crc32(orjson.dumps(body.get("messages", body.get("prompt")), option=orjson.OPT_SORT_KEYS))
    rng = random.Random(seed)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise SimRequestError("max_tokens must be a positive integer", "max_tokens")
    n = body.get("n") or 1
    stop = body.get("stop")
    if isinstance(stop, list):
        stop = stop[0] if stop else None
    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice")
    tool_names = [t.get("function", {}).get("name", "tool") for t in tools if isinstance(t, dict)]
    if isinstance(tool_choice, dict):
        tool_names = [tool_choice.get("function", {}).get("name", "tool")]
    elif tool_choice != "required":
        tool_names = []
    if output == "multi-tool" and not tool_names:
        tool_names = ["lookup", "search"]
    elif output == "multi-tool" and len(tool_names) == 1:
        tool_names = tool_names * 2
    elif output != "multi-tool":
        tool_names = tool_names[:1]
    if chat:
        logprobs = bool(body.get("logprobs"))
        top = int(body.get("top_logprobs") or 0)
    else:
        lp = body.get("logprobs")
        logprobs = lp is not None and lp is not False
        top = int(lp) if isinstance(lp, int) and not isinstance(lp, bool) else 0
    stream_options = body.get("stream_options") or {}
    plan = Plan(
        chat=chat,
        stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        return_token_ids=opts.dialect == "vllm" and bool(body.get("return_token_ids")),
        prompt_tokens=prompt_tokens,
        prompt_token_ids=[TOKEN_ID_BASE + (b % len(VOCAB)) for b in text.encode()[:prompt_tokens]]
        or [TOKEN_ID_BASE],
        n=n,
        max_tokens=max_tokens,
        seed=seed,
        fault=fault,
        output=output if chat else None,
        tool_names=tool_names if chat else [],
        logprobs=logprobs,
        top_logprobs=top,
        stop=stop if isinstance(stop, str) else None,
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{seed & 0xFFFFFFFF:08x}{rng.getrandbits(32):08x}",
        created=int(time.time()),
        model=opts.model,
        dialect=opts.dialect,
        reasoning=opts.reasoning if chat else "none",
    )
    for _ in range(n):
        length = max_tokens if max_tokens is not None else rng.randint(8, 32)
        plan.choices.append(_choice_plan(plan, length, rng))
    return plan


def _choice_plan(plan: Plan, length: int, rng: random.Random) -> list[tuple[Any, int]]:
    words = [rng.randrange(len(VOCAB)) for _ in range(length)]
    kinds: list[Any]
    if plan.output == "refusal":
        kinds = ["refusal"] * length
    elif plan.output == "function-call":
        kinds = ["function"] * length
    elif plan.tool_names:
        calls = len(plan.tool_names)
        kinds = [("tool", min(i * calls // length, calls - 1)) for i in range(length)]
    elif plan.reasoning != "none":
        split = length // 2
        kinds = ["reasoning"] * split + ["content"] * (length - split)
    else:
        kinds = ["content"] * length
    return list(zip(kinds, words, strict=True))


def finish_reason(plan: Plan) -> str:
    if plan.output == "function-call":
        return "function_call"
    if plan.tool_names:
        return "tool_calls"
    return "length" if plan.max_tokens is not None else "stop"


def stop_reason(plan: Plan) -> str | int | None:
    if plan.max_tokens is not None:
        return None
    return plan.stop


def _token_ids(plan: Plan, words: list[int]) -> Any:
    ids = [TOKEN_ID_BASE + w for w in words]
    if plan.fault == "bool-token-id":
        return [True]
    if plan.fault == "malformed-token-ids":
        return "not-a-list"
    return ids


def _logprob(word: int) -> float:
    return -round(0.05 + (word % 17) / 10.0, 4)


def _chat_logprob_entry(plan: Plan, word: int) -> dict[str, Any]:
    tok = " " + VOCAB[word]
    top = [
        {"token": " " + VOCAB[(word + k) % len(VOCAB)], "logprob": _logprob(word + k),
         "bytes": list((" " + VOCAB[(word + k) % len(VOCAB)]).encode())}
        for k in range(plan.top_logprobs)
    ]
    return {"token": tok, "logprob": _logprob(word), "bytes": list(tok.encode()), "top_logprobs": top}


def _tool_arguments(words: list[int]) -> list[str]:
    """Argument fragments that join into a JSON object, one fragment per token."""
    if not words:
        return []
    if len(words) == 1:
        return [f'{{"q": "{VOCAB[words[0]]}"}}']
    frags = [f'{{"q": "{VOCAB[words[0]]}']
    frags += [f" {VOCAB[w]}" for w in words[1:-1]]
    frags.append(f' {VOCAB[words[-1]]}"}}')
    return frags


@dataclass(slots=True)
class Step:
    """One engine iteration's output for one choice: the tokens and their delta."""

    index: int
    words: list[int]
    delta: dict[str, Any]
    text: str
    logprobs: Any = None
    finish: bool = False


def steps(plan: Plan) -> Iterator[list[Step]]:
    """Yield one list of per-choice steps per engine iteration (one token each)."""
    per_choice = [_choice_steps(plan, i, toks) for i, toks in enumerate(plan.choices)]
    longest = max(len(s) for s in per_choice)
    for k in range(longest):
        yield [s[k] for s in per_choice if k < len(s)]


def _choice_steps(plan: Plan, index: int, toks: list[tuple[Any, int]]) -> list[Step]:
    out: list[Step] = []
    # Argument fragments per tool call, laid out over that call's tokens.
    call_words: dict[int, list[int]] = {}
    for kind, word in toks:
        if isinstance(kind, tuple):
            call_words.setdefault(kind[1], []).append(word)
    call_frags = {c: _tool_arguments(w) for c, w in call_words.items()}
    call_pos: dict[int, int] = {}
    fn_words = [w for k, w in toks if k == "function"]
    fn_frags = _tool_arguments(fn_words)
    offset = 0
    for pos, (kind, word) in enumerate(toks):
        piece = " " + VOCAB[word]
        delta: dict[str, Any] = {}
        text = piece
        logprobs: Any = None
        if not plan.chat:
            logprobs = (
                {"text_offset": [offset], "token_logprobs": [_logprob(word)], "tokens": [piece],
                 "top_logprobs": [{" " + VOCAB[(word + k) % len(VOCAB)]: _logprob(word + k)
                                   for k in range(max(plan.top_logprobs, 1))}]}
                if plan.logprobs else None
            )
            offset += len(piece)
        elif kind == "content":
            delta["content"] = piece
            if plan.logprobs:
                logprobs = {"content": [_chat_logprob_entry(plan, word)], "refusal": None}
        elif kind == "reasoning":
            if plan.reasoning in ("reasoning", "both"):
                delta["reasoning"] = piece
            if plan.reasoning in ("reasoning_content", "both"):
                delta["reasoning_content"] = piece
        elif kind == "refusal":
            delta["refusal"] = piece
            if plan.logprobs:
                logprobs = {"content": None, "refusal": [_chat_logprob_entry(plan, word)]}
        elif kind == "function":
            frag = fn_frags[pos]
            delta["function_call"] = {"name": "legacy_fn", "arguments": frag} if pos == 0 else {
                "arguments": frag}
        else:
            call = kind[1]
            i = call_pos.get(call, 0)
            call_pos[call] = i + 1
            frag = call_frags[call][i]
            if i == 0:
                tc = {"id": f"chatcmpl-tool-{plan.seed & 0xFFFF:04x}{index}{call}", "type": "function",
                      "index": call, "function": {"name": plan.tool_names[call], "arguments": frag}}
            else:
                tc = {"index": call, "function": {"arguments": frag}}
            delta["tool_calls"] = [tc]
        if plan.chat and pos == 1:
            if plan.fault == "audio":
                delta["audio"] = {"id": "audio-1", "data": "AAAA", "transcript": "x", "expires_at": 0}
            elif plan.fault == "annotations":
                delta["annotations"] = [{"type": "url_citation", "url_citation": {"url": "http://x"}}]
        out.append(Step(index=index, words=[word], delta=delta, text=text, logprobs=logprobs,
                        finish=pos == len(toks) - 1))
    return out


def _usage(plan: Plan) -> dict[str, int]:
    completion = sum(len(c) for c in plan.choices)
    return {"prompt_tokens": plan.prompt_tokens, "total_tokens": plan.prompt_tokens + completion,
            "completion_tokens": completion}


def _base(plan: Plan) -> dict[str, Any]:
    return {"id": plan.request_id,
            "object": "chat.completion.chunk" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model}


def stream_events(plan: Plan) -> Iterator[tuple[str, bytes]]:
    """Yield (kind, SSE bytes) in engine order; kind 'first' marks the first token.

    The kinds let the I/O layer pace output (prefill before 'first', TPOT before each
    'token') and inject transport faults without this function knowing about time.
    """
    vllm = plan.dialect == "vllm"
    step_no = 0
    if plan.chat:
        for index in range(plan.n):
            choice: dict[str, Any] = {"index": index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}
            chunk = _base(plan) | {"choices": [choice]}
            if plan.return_token_ids:
                choice["token_ids"] = []
                if index == 0:
                    chunk["prompt_token_ids"] = plan.prompt_token_ids
            yield "role", _sse(chunk)
    for group in steps(plan):
        for st in group:
            chunk = _base(plan)
            if plan.chat:
                choice = {"index": st.index, "delta": st.delta, "logprobs": st.logprobs,
                          "finish_reason": None}
            else:
                choice = {"index": st.index, "text": st.text, "logprobs": st.logprobs,
                          "finish_reason": None}
                if vllm:
                    choice["stop_reason"] = None
            if plan.return_token_ids:
                if not (plan.fault == "omit-token-ids" and step_no == 2):
                    choice["token_ids"] = _token_ids(plan, st.words)
                if not plan.chat and step_no == 0 and st.index == 0:
                    chunk["prompt_token_ids"] = plan.prompt_token_ids
            chunk["choices"] = [choice]
            if st.finish:
                choice["finish_reason"] = finish_reason(plan)
                if vllm:
                    choice["stop_reason"] = stop_reason(plan)
            yield ("first" if step_no == 0 else "token"), _sse(chunk)
            step_no += 1
            if plan.fault == "error-event" and step_no == 3:
                yield "error", _sse({"error": {"message": "simulated engine failure",
                                                "type": "InternalServerError", "param": None,
                                                "code": 500}})
                return
            if plan.fault == "abrupt-close" and step_no == 3:
                yield "abort", b""
                return
    if plan.include_usage and plan.fault != "omit-usage":
        yield "usage", _sse(_base(plan) | {"choices": [], "usage": _usage(plan)})
    yield "done", b"data: [DONE]\n\n"


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def full_response(plan: Plan) -> dict[str, Any]:
    """The non-streaming response vLLM returns for the same plan."""
    vllm = plan.dialect == "vllm"
    choices: list[dict[str, Any]] = []
    per_choice: dict[int, list[Step]] = {}
    for group in steps(plan):
        for st in group:
            per_choice.setdefault(st.index, []).append(st)
    for index in range(plan.n):
        sts = per_choice.get(index, [])
        words = [w for st in sts for w in st.words]
        choice: dict[str, Any] = {"index": index}
        if plan.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": None, "refusal": None,
                                   "annotations": None, "audio": None, "function_call": None,
                                   "tool_calls": []}
            content = "".join(st.delta.get("content", "") for st in sts)
            msg["content"] = content or None
            reasoning = "".join(st.delta.get("reasoning", st.delta.get("reasoning_content", ""))
                                for st in sts)
            if plan.reasoning in ("reasoning", "both"):
                msg["reasoning"] = reasoning or None
            if plan.reasoning in ("reasoning_content", "both"):
                msg["reasoning_content"] = reasoning or None
            refusal = "".join(st.delta.get("refusal", "") for st in sts)
            msg["refusal"] = refusal or None
            fn = [st.delta["function_call"] for st in sts if "function_call" in st.delta]
            if fn:
                msg["function_call"] = {"name": fn[0]["name"],
                                        "arguments": "".join(f["arguments"] for f in fn)}
            calls: dict[int, dict[str, Any]] = {}
            for st in sts:
                for tc in st.delta.get("tool_calls", []):
                    cur = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                          "function": {"name": None, "arguments": ""}})
                    if "id" in tc:
                        cur["id"] = tc["id"]
                    if "name" in tc["function"]:
                        cur["function"]["name"] = tc["function"]["name"]
                    cur["function"]["arguments"] += tc["function"]["arguments"]
            msg["tool_calls"] = [calls[k] for k in sorted(calls)]
            choice["message"] = msg
            if plan.logprobs:
                key = "refusal" if plan.output == "refusal" else "content"
                entries = [e for st in sts if st.logprobs for e in st.logprobs[key]]
                choice["logprobs"] = {"content": None, "refusal": None} | {key: entries}
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = "".join(st.text for st in sts)
            if plan.logprobs:
                lp: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                                            "top_logprobs": []}
                for st in sts:
                    for key in lp:
                        lp[key].extend(st.logprobs[key])
                choice["logprobs"] = lp
            else:
                choice["logprobs"] = None
        choice["finish_reason"] = finish_reason(plan)
        if vllm:
            choice["stop_reason"] = stop_reason(plan)
            if plan.return_token_ids:
                choice["token_ids"] = [TOKEN_ID_BASE + w for w in words]
        choices.append(choice)
    resp = {"id": plan.request_id, "object": "chat.completion" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model, "choices": choices, "usage": _usage(plan)}
    if plan.return_token_ids:
        resp["prompt_token_ids"] = plan.prompt_token_ids
    return resp

"""Deterministic output generation in vLLM 0.32's OpenAI wire format, without I/O.

The simulator must be faithful to vLLM's wire shape (that is what Narwhal parses in
production; a conformance test compares the two side by side) and deterministic per
``seed`` (tests compare streaming against non-streaming output), so generation is a
pure function of the request, the simulator's options and the fault header.

Facts of vLLM 0.32 reproduced here: the chat role event carries ``prompt_token_ids``
and ``prompt_text: null`` at the top level and no ``token_ids``; completion events carry
``prompt_token_ids`` (first event) and ``token_ids`` per choice, ``null`` when not asked
for; tokens a parser swallows (tool-call markup) are events with an empty delta, sent
only to clients that asked for IDs or logprobs; a tool call's first fragment is ``{id,
type, index, function: {name}}`` and the rest carry arguments only, beside ``content:
null``; ``finish_reason`` is ``tool_calls`` for auto/required, ``stop`` for a named
function, ``length`` when cut; the usage event carries ``system_fingerprint`` (the
final choice event does when no usage was asked for); errors found after the stream
opened are an error event followed by ``[DONE]``.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from .batching import BLOCK_SIZE

VOCAB = tuple(
    "the quick brown fox jumps over lazy dog narwhal tusk ocean arctic ice whale pod "
    "swim deep cold water light wave router engine token prefill decode budget queue "
    "admit place stream chunk event model pool latency fast slow calm blue green red "
    "north south east west sun moon star cloud rain snow wind river stone tree leaf"
    .split()
)
TOKEN_ID_BASE = 1000
VOCAB_SIZE = 32768  # the simulated model's vocabulary: token-ID prompts must be under it
MARKUP_ID = 7  # the id of tool-call markup tokens (``<tool_call>``, ``</tool_call>``)
SYSTEM_FINGERPRINT = "vllm-0.32.0-narwhalsim"
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
FAULTS = frozenset(
    {
        "omit-token-ids",
        "bool-token-id",
        "malformed-token-ids",
        "audio",
        "annotations",
        "error-event",
        "abrupt-close",
        "cut-short",
        "overrun",
        "dribble",
        "blank-lines",
        "padding",
        "empty-events",
        "linger",
        "slow-start",
        "omit-usage",
        "stall",
        "keepalive",
    }
)
FILLER_BYTES = 4 << 20  # what each filler fault (FILLERS) sends at once
FILLERS = {"blank-lines": b"\n", "padding": b": " + b"x" * 4092 + b"\n\n",  # repeated
           "empty-events": b'data: {"choices":[]}\n\n'}
OUTPUTS = frozenset({"refusal", "function-call", "multi-tool"})
DIALECTS = frozenset({"vllm", "openai"})
REASONING_MODES = frozenset({"none", "reasoning", "reasoning_content", "both"})


class SimRequestError(ValueError):
    """A request the simulated engine refuses, with vLLM's status and envelope."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.kind = kind

    def envelope(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True, slots=True)
class SimOptions:
    model: str = "narwhal-sim"
    dialect: str = "vllm"
    reasoning: str = "none"
    max_model_len: int = 32768
    # Median of a natural output length (a model that stops by itself), 0: run to
    # max_tokens. Each conversation's first message scales it (0.5x to 2x), as an
    # application's system prompt shapes its answers.
    natural_output: int = 0
    # Sent back as response header x-sim-engine, so that a benchmark knows who served.
    engine_name: str = ""
    # A fault for every request without an x-sim-fault header (a broken engine).
    fault: str | None = None
    # vLLM's --enable-prompt-tokens-details: usage says how much of the prompt was a
    # prefix-cache hit (``prompt_tokens_details.cached_tokens``).
    prompt_tokens_details: bool = False


@dataclass(slots=True)
class Tok:
    """One generated token and what a parser makes of it."""

    id: int
    kind: str  # content | reasoning | refusal | text | markup | tool | function
    piece: str = ""  # visible text, or a tool / function argument fragment
    call: int = 0  # tool call index
    head: bool = False  # the fragment that carries the call's id, type and name
    word: int = 0


@dataclass(slots=True)
class Plan:
    """What one request will produce: the engine decides this before it 'runs'."""

    chat: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    prompt_text: str
    prompt_tokens: int
    prompt_token_ids: list[int]
    n: int
    max_tokens: int | None
    seed: int
    fault: str | None
    output: str | None
    tool_names: list[str]
    named_tool: bool
    logprobs: bool
    top_logprobs: int
    stop: list[str]
    echo: bool
    include_reasoning: bool
    request_id: str
    created: int
    model: str
    dialect: str
    reasoning: str
    stream_error: SimRequestError | None = None  # found after the stream opened
    natural_median: float = 0.0  # see SimOptions.natural_output
    prompt_tokens_details: bool = False  # see SimOptions.prompt_tokens_details
    cached_tokens: int = 0  # the prefix-cache hit, once the engine scheduled the prompt
    choices: list[list[Tok]] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    stop_reasons: list[str | None] = field(default_factory=list)

    @property
    def reasoning_hidden(self) -> bool:
        """``include_reasoning: false`` under a reasoning parser: vLLM sends no reasoning
        and nulls every event's token IDs."""
        return not self.include_reasoning and self.reasoning != "none"


def _render(body: dict[str, Any]) -> str:
    """The prompt as the engine sees it: a ChatML template for chat, tools included."""
    if "messages" not in body:
        prompt = body.get("prompt", "")
        return str(prompt) if not isinstance(prompt, list) else ""
    parts: list[str] = []
    tools = body.get("tools")
    if tools:
        parts.append("<|im_start|>system\n# Tools\n<tools>\n"
                     + "\n".join(orjson.dumps(t).decode() for t in tools) + "\n</tools><|im_end|>\n")
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{message.get('role')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def count_prompt_tokens(text: str) -> int:
    """A 4-bytes-per-token tokenizer over the rendered prompt: stable, so routers can learn."""
    return max(1, (len(text.encode()) + 3) // 4)


def pydantic_error(loc: str, kind: str, msg: str) -> SimRequestError:
    """A refusal of vLLM's request validation (pydantic): its message shape, ``param``
    the field's dotted location, type ``Bad Request``."""
    return SimRequestError(f"1 validation error:\n  {{'type': '{kind}', 'loc': '{loc}', "
                           f"'msg': '{msg}'}}", loc, kind="Bad Request")


def _int(body: dict[str, Any], key: str) -> int | None:
    """An integer field as pydantic's lax mode reads it (``2.0`` is 2)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        if isinstance(value, float):
            raise pydantic_error(f"body.{key}", "int_from_float",
                            "Input should be a valid integer, got a number with a fractional part")
        raise pydantic_error(f"body.{key}", "int_type", "Input should be a valid integer")
    return value


def _max_tokens(body: dict[str, Any]) -> int | None:
    """The output cap: ``max_completion_tokens``, else ``max_tokens``."""
    cap = _int(body, "max_completion_tokens")
    return cap if cap is not None else _int(body, "max_tokens")


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise pydantic_error(f"body.{key}", "float_parsing",
                        "Input should be a valid number, unable to parse string as a number")
    return float(value)


def _validate_sampling(body: dict[str, Any], chat: bool) -> None:
    """vLLM's checks of the sampling fields, in its order, with its wording."""
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise pydantic_error("body.stop", "string_type", "Input should be a valid string")
    for key in ("user", "request_id"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise pydantic_error(f"body.{key}", "string_type", "Input should be a valid string")
    if body.get("stream_options") and not body.get("stream"):
        raise SimRequestError("Stream options can only be defined when `stream=True`.",
                              "stream_options")
    if not chat and body.get("suffix") is not None:
        raise SimRequestError("suffix is only supported for models with FIM completion "
                              "rendering", "suffix")
    for key in ("presence_penalty", "frequency_penalty"):
        value = _number(body, key)
        if value is not None and not -2.0 <= value <= 2.0:
            raise SimRequestError(f"{key} must be in [-2, 2], got {value}.")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise SimRequestError(f"top_p must be in (0, 1], got {top_p}. (parameter=top_p, "
                              f"value={top_p})", "top_p")
    top_k = _int(body, "top_k")
    if top_k is not None and top_k < -1:
        raise SimRequestError(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_tokens = _int(body, "min_tokens")
    cap = _max_tokens(body)
    if min_tokens is not None and cap is not None and min_tokens > cap:
        raise SimRequestError(f"min_tokens must be less than or equal to max_tokens={cap}, "
                              f"got {min_tokens}")


def _validate(body: dict[str, Any], opts: SimOptions, prompt_tokens: int, chat: bool) -> None:
    """The refusals vLLM answers before opening a stream (HTTP 400/404 with its envelope)."""
    model = body.get("model")
    if model not in (None, opts.model):
        raise SimRequestError(f"The model `{model}` does not exist.", "model", 404,
                              "NotFoundError")
    seed = body.get("seed")
    # orjson reads an integer past 64 bits as a float (-2**63 - 1 becomes -2.0**63)
    if (isinstance(seed, float) and seed.is_integer() and abs(seed) >= 2**63
            or isinstance(seed, int) and not -2**63 <= seed < 2**63):
        kind, bound = (("less_than_equal", "less than or equal to 9223372036854775807")
                       if seed > 0 else
                       ("greater_than_equal", "greater than or equal to -9223372036854775808"))
        raise pydantic_error("body.seed", kind, f"Input should be {bound}")
    interval = _int(body, "stream_interval")
    if interval is not None and interval < 1:
        raise pydantic_error("body.stream_interval", "greater_than_equal",
                             "Input should be greater than or equal to 1")
    _int(body, "seed")
    temperature = _number(body, "temperature")
    if temperature is not None and temperature < 0:
        raise SimRequestError(f"temperature must be non-negative, got {float(temperature)}. "
                              f"(parameter=temperature, value={float(temperature)})", "temperature")
    for key in ("max_completion_tokens", "max_tokens"):
        value = _int(body, key)
        if value is None:
            continue
        if value < 1:
            raise SimRequestError(f"{key} must be at least 1, got {value}.", key)
        if value > opts.max_model_len - prompt_tokens:
            raise SimRequestError(
                f"{key}={value} cannot be greater than max_model_len={opts.max_model_len}. "
                f"Please request fewer output tokens. (parameter={key}, value={value})", key)
        break
    if chat and body.get("logprobs") is False and body.get("top_logprobs"):
        raise SimRequestError("top_logprobs requires logprobs", "top_logprobs")
    _validate_sampling(body, chat)


def _validate_messages(messages: object, model: str) -> None:
    """What vLLM refuses in messages before any template: a user, system or developer
    message whose content is null (a present key: an absent one passes), a content part
    that is not an object or a text part whose text is not a string (400s without
    ``param``), and any part but text on a text-only model."""
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if "content" in m and content is None and m.get("role") in (
                "user", "system", "developer"):
            raise pydantic_error(f"body.messages.{i}.ChatCompletionDeveloperMessageParam.content",
                            "string_type", "Input should be a valid string")
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or (part.get("type") == "text"
                                              and not isinstance(part.get("text"), str)):
                raise SimRequestError(f"validation errors for ValidatorIterator\n"
                                      f"{j}.ChatCompletionContentPartTextParam.text\n"
                                      f"  Input should be a valid string")
            if part.get("type") != "text":
                raise SimRequestError(f"{model} is not a multimodal model")


def _validate_prompt(prompt: object) -> None:
    """vLLM's refusals of an empty prompt and of negative token IDs."""
    if prompt == []:
        raise SimRequestError("You must pass at least one prompt")
    if prompt == "":
        raise SimRequestError("Either prompt or prompt_embeds must be provided and non-empty.",
                              "prompt")
    if isinstance(prompt, list) and any(isinstance(p, int) and p < 0 for p in prompt):
        raise pydantic_error("body.prompt.0", "greater_than_equal",
                        "Input should be greater than or equal to 0")


def _logprob_request(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    if chat:
        return bool(body.get("logprobs")), int(body.get("top_logprobs") or 0)
    lp = body.get("logprobs")
    if lp is None or lp is False:
        return False, 0
    return True, int(lp) if isinstance(lp, int) else 0


def _answer_id(body: dict[str, Any], header_id: str | None) -> str:
    if header_id is not None:
        return header_id
    asked = body.get("request_id")  # a string, or refused by _validate_sampling
    return asked if isinstance(asked, str) else uuid.uuid4().hex


def make_plan(body: dict[str, Any], opts: SimOptions, fault: str | None,
              output: str | None, header_id: str | None = None) -> Plan:
    """The whole answer to ``body``, decided up front. Its ``id`` is vLLM's: the
    ``X-Request-Id`` header (``header_id``; Envoy sets one on every request it proxies),
    else the body's ``request_id``, else a fresh UUID, so that no two answers share one
    unless their callers asked (the generated text is still a function of the seed)."""
    chat = "messages" in body
    if not chat and "prompt" not in body:
        raise SimRequestError("either messages or prompt is required", "messages")
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0],
                                                                                  str | list):
        prompt = prompt[0]  # a batch of one is its one prompt, as in vLLM
        body = body | {"prompt": prompt}
    if chat:  # before the template renders the parts
        _validate_messages(body["messages"], opts.model)
    else:
        _validate_prompt(prompt)
    text = _render(body)
    token_prompt = isinstance(prompt, list) and all(isinstance(p, int) for p in prompt)
    prompt_ids = ([int(p) for p in prompt] if token_prompt and prompt else
                  [TOKEN_ID_BASE + (b % len(VOCAB)) for b in text.encode()[::4]] or [TOKEN_ID_BASE])
    prompt_tokens = len(prompt_ids) if token_prompt else count_prompt_tokens(text)
    prompt_ids = prompt_ids[:prompt_tokens]
    _validate(body, opts, prompt_tokens, chat)
    seed = body.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool):
        seed = zlib.crc32(orjson.dumps(body.get("messages", body.get("prompt")),
                                       option=orjson.OPT_SORT_KEYS))
    rng = random.Random(seed)
    max_tokens = _max_tokens(body)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or () if isinstance(s, str)]
    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice")
    tool_names = [t.get("function", {}).get("name", "tool") for t in tools if isinstance(t, dict)]
    named = isinstance(tool_choice, dict)
    if named:
        tool_names = [tool_choice.get("function", {}).get("name", "tool")]
    elif tool_choice != "required":
        tool_names = []
    if output == "multi-tool":
        tool_names = (tool_names * 2)[:2] if tool_names else ["lookup", "search"]
    else:
        tool_names = tool_names[:1]
    logprobs, top = _logprob_request(body, chat)
    stream_options = body.get("stream_options") or {}
    include_reasoning = body.get("include_reasoning", True) is not False
    ids = opts.dialect == "vllm" and bool(body.get("return_token_ids"))
    plan = Plan(
        chat=chat,
        stream=bool(body.get("stream")),
        include_usage=bool(stream_options.get("include_usage")),
        return_token_ids=ids,
        prompt_text=text if not token_prompt else "",
        prompt_tokens=prompt_tokens,
        prompt_token_ids=prompt_ids,
        n=body.get("n") or 1,
        max_tokens=max_tokens,
        seed=seed,
        fault=fault,
        output=output if chat else None,
        tool_names=tool_names if chat else [],
        named_tool=named,
        logprobs=logprobs,
        top_logprobs=top,
        stop=stops,
        echo=not chat and body.get("echo") is True,
        include_reasoning=include_reasoning,
        request_id=f"{'chatcmpl' if chat else 'cmpl'}-{_answer_id(body, header_id)}",
        created=int(time.time()),
        model=opts.model,
        dialect=opts.dialect,
        reasoning=opts.reasoning if chat else "none",
        prompt_tokens_details=opts.dialect == "vllm" and opts.prompt_tokens_details,
    )
    if opts.natural_output:
        first = (body.get("messages") or [{}])[0]
        kind = zlib.crc32(orjson.dumps(first.get("content") if isinstance(first, dict)
                                       else first)) % 4
        plan.natural_median = opts.natural_output * (0.5, 1.0, 1.5, 2.0)[kind]
    beyond = next((i for i in prompt_ids if i >= VOCAB_SIZE), None) if token_prompt else None
    if beyond is not None:
        # vLLM checks this after a stream has opened too (a 400 without one)
        plan.stream_error = SimRequestError(f"Token id {beyond} is out of vocabulary")
    elif logprobs and top > MAX_LOGPROBS:
        # vLLM checks this in its engine, after a stream has opened.
        plan.stream_error = SimRequestError(
            f"Requested sample logprobs of {top}, which is greater than max allowed: "
            f"{MAX_LOGPROBS} (parameter=logprobs, value={top})", "logprobs")
    if fault == "overrun" and plan.max_tokens is not None:
        plan.max_tokens += 4  # an engine that does not stop at the request's max_tokens
    for index in range(plan.n):
        toks, finish = _choice_tokens(plan, index, rng)
        plan.choices.append(toks)
        plan.finish.append(finish[0])
        plan.stop_reasons.append(finish[1])
    return plan


def _word_tok(rng: random.Random, kind: str) -> Tok:
    word = rng.randrange(len(VOCAB))
    return Tok(TOKEN_ID_BASE + word, kind, " " + VOCAB[word], word=word)


def _tool_arguments(words: list[int]) -> list[str]:
    """Argument fragments that join into a JSON object, one fragment per token."""
    if len(words) == 1:
        return [f'{{"q": "{VOCAB[words[0]]}"}}']
    frags = [f'{{"q": "{VOCAB[words[0]]}']
    frags += [f" {VOCAB[w]}" for w in words[1:-1]]
    frags.append(f' {VOCAB[words[-1]]}"}}')
    return frags


def _tool_tokens(plan: Plan, length: int, rng: random.Random) -> list[Tok]:
    """Each call: ``<tool_call>`` markup, the name, argument fragments, ``</tool_call>``."""
    calls = len(plan.tool_names)
    toks: list[Tok] = []
    for call, name in enumerate(plan.tool_names):
        budget = max(1, (length - 3 * calls) // calls) if length else rng.randint(3, 10)
        words = [rng.randrange(len(VOCAB)) for _ in range(budget)]
        toks.append(Tok(MARKUP_ID, "markup", call=call))
        toks.append(Tok(TOKEN_ID_BASE + words[0], "tool", name, call=call, head=True,
                        word=words[0]))
        toks += [Tok(TOKEN_ID_BASE + w, "tool", frag, call=call, word=w)
                 for w, frag in zip(words, _tool_arguments(words), strict=True)]
        toks.append(Tok(MARKUP_ID + 1, "markup", call=call))
    return toks


def _choice_tokens(plan: Plan, index: int, rng: random.Random
                   ) -> tuple[list[Tok], tuple[str, str | None]]:
    """The choice's tokens and its (finish_reason, stop_reason)."""
    cap = plan.max_tokens
    natural = cap if cap is not None else rng.randint(8, 32)
    if plan.natural_median:
        pick = random.Random(plan.seed * 31 + index)
        natural = max(1, round(pick.lognormvariate(math.log(plan.natural_median), 0.5)))
        if cap is not None and natural >= cap:
            natural = cap
        else:
            cap = None  # it stops by itself: finish_reason "stop"
    if plan.tool_names:
        toks = _tool_tokens(plan, natural if cap is not None else 0, rng)
        if cap is not None and len(toks) > cap:
            return toks[:cap], ("length", None)
        return toks, ("stop" if plan.named_tool else "tool_calls", None)
    if plan.output == "function-call":
        words = [rng.randrange(len(VOCAB)) for _ in range(natural)]
        return ([Tok(TOKEN_ID_BASE + w, "function", f, head=i == 0, word=w)
                 for i, (w, f) in enumerate(zip(words, _tool_arguments(words), strict=True))],
                ("function_call", None))
    if plan.output == "refusal":
        kinds = ["refusal"] * natural
    elif not plan.chat:
        kinds = ["text"] * natural
    elif plan.reasoning != "none":
        split = natural // 2
        kinds = ["reasoning"] * split + ["content"] * (natural - split)
    else:
        kinds = ["content"] * natural
    toks = [_word_tok(rng, kind) for kind in kinds]
    if plan.stop:
        text = ""
        for pos, tok in enumerate(toks):
            before = len(text)
            text += tok.piece
            hits = [(text.find(s, max(0, before - len(s) + 1)), s) for s in plan.stop]
            hits = [(at, s) for at, s in hits if at >= 0]
            if hits:
                at, s = min(hits)
                tok.piece = tok.piece[:max(0, at - before)]
                return toks[:pos + 1], ("stop", s)
    return toks, ("length" if cap is not None else "stop", None)


def _bad_ids(plan: Plan, ids: list[int]) -> Any:
    if plan.fault == "bool-token-id":
        return [True]
    if plan.fault == "malformed-token-ids":
        return "not-a-list"
    return ids


def _logprob(word: int) -> float:
    return -round(0.05 + (word % 17) / 10.0, 4)


def _alt(word: int, k: int) -> str:
    return " " + VOCAB[(word + k) % len(VOCAB)]


def _chat_logprob_entry(plan: Plan, tok: Tok) -> dict[str, Any]:
    top = [{"token": _alt(tok.word, k), "logprob": _logprob(tok.word + k),
            "bytes": list(_alt(tok.word, k).encode())} for k in range(plan.top_logprobs)]
    return {"token": tok.piece, "logprob": _logprob(tok.word), "bytes": list(tok.piece.encode()),
            "top_logprobs": top}


def _text_logprobs(plan: Plan, tok: Tok, offset: int) -> dict[str, Any]:
    # The sampled token plus the N most likely: N + 1 entries when it is not among them.
    top = {tok.piece: _logprob(tok.word)} | {_alt(tok.word, k): _logprob(tok.word + k)
                                             for k in range(1, plan.top_logprobs + 1)}
    return {"text_offset": [offset], "token_logprobs": [_logprob(tok.word)],
            "tokens": [tok.piece], "top_logprobs": [top]}


def _tool_id(plan: Plan, index: int, call: int) -> str:
    digest = hashlib.blake2b(f"{plan.seed}/{index}/{call}".encode(), digest_size=8).hexdigest()
    return f"chatcmpl-tool-{digest}"


def _delta(plan: Plan, index: int, tok: Tok) -> dict[str, Any] | None:
    """The chat delta a token becomes; None when a parser swallows it (markup, hidden
    reasoning)."""
    if tok.kind == "markup":
        return None
    if tok.kind == "reasoning":
        if not plan.include_reasoning:
            return None
        delta = {}
        if plan.reasoning in ("reasoning", "both"):
            delta["reasoning"] = tok.piece
        if plan.reasoning in ("reasoning_content", "both"):
            delta["reasoning_content"] = tok.piece
        return delta
    if tok.kind == "tool":
        if tok.head:
            call = {"id": _tool_id(plan, index, tok.call), "type": "function", "index": tok.call,
                    "function": {"name": tok.piece}}
        else:
            call = {"index": tok.call, "function": {"arguments": tok.piece}}
        return {"content": None, "tool_calls": [call]}
    if tok.kind == "function":
        return {"function_call": {"name": "legacy_fn", "arguments": tok.piece}
                if tok.head else {"arguments": tok.piece}}
    delta = {tok.kind: tok.piece}
    if plan.reasoning_hidden:
        delta["reasoning"] = None
    return delta


def _usage(plan: Plan) -> dict[str, Any]:
    completion = sum(len(c) for c in plan.choices)
    usage: dict[str, Any] = {"prompt_tokens": plan.prompt_tokens,
                             "total_tokens": plan.prompt_tokens + completion,
                             "completion_tokens": completion}
    if plan.reasoning != "none":
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(
            1 for c in plan.choices for t in c if t.kind == "reasoning")}
    if plan.prompt_tokens_details:
        # vLLM: the hit, and the prompt's full blocks it computed and cached besides.
        full = plan.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
        usage["prompt_tokens_details"] = {
            "cached_tokens": plan.cached_tokens,
            "created_cache_tokens": max(0, full - plan.cached_tokens),
            "multimodal_tokens": None}
    return usage


def _base(plan: Plan) -> dict[str, Any]:
    return {"id": plan.request_id,
            "object": "chat.completion.chunk" if plan.chat else "text_completion",
            "created": plan.created, "model": plan.model}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _events(plan: Plan) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """(kind, event) in engine order, before faults; kinds: role, token, usage."""
    vllm = plan.dialect == "vllm"
    ids = plan.return_token_ids
    if plan.chat:
        for index in range(plan.n):
            chunk = _base(plan) | {"choices": [{"index": index,
                                                "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]}
            if vllm:
                chunk["prompt_token_ids"] = plan.prompt_token_ids if ids else None
                chunk["prompt_text"] = None
            yield "role", chunk
    longest = max(len(c) for c in plan.choices)
    offsets = [0] * plan.n
    for pos in range(longest):
        for index, toks in enumerate(plan.choices):
            if pos >= len(toks):
                continue
            tok = toks[pos]
            last = pos == len(toks) - 1
            lp: Any = None
            if plan.chat:
                delta = _delta(plan, index, tok)
                if plan.logprobs and tok.kind in ("content", "refusal") and delta is not None:
                    lp = {tok.kind: [_chat_logprob_entry(plan, tok)]}
                if delta is None:
                    if not last and lp is None and (not ids or plan.reasoning_hidden):
                        yield "token", None  # a token the client never sees
                        continue
                    delta = {}
                choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": lp,
                                          "finish_reason": None}
                if vllm:
                    choice["token_ids"] = [tok.id] if ids and not plan.reasoning_hidden else None
            else:
                text = tok.piece
                if pos == 0 and plan.echo and not ids:
                    text = plan.prompt_text + text  # vLLM 0.32 drops the echo with IDs
                if plan.logprobs:
                    lp = _text_logprobs(plan, tok, offsets[index])
                offsets[index] += len(text)
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": None}
                if vllm:
                    choice["stop_reason"] = None
                    choice["prompt_token_ids"] = (plan.prompt_token_ids
                                                  if pos == 0 and (ids or plan.echo) else None)
                    choice["token_ids"] = [tok.id] if ids else None
            chunk = _base(plan) | {"choices": [choice]}
            if last:
                choice["finish_reason"] = plan.finish[index]
                if vllm:
                    choice["stop_reason"] = plan.stop_reasons[index]
                if not plan.include_usage:
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
            yield "token", chunk
    if plan.include_usage and plan.fault != "omit-usage":
        yield "usage", _base(plan) | {"choices": [], "usage": _usage(plan),
                                      "system_fingerprint": SYSTEM_FINGERPRINT}


def stream_events(plan: Plan) -> Iterator[tuple[str, bytes]]:
    """Yield (kind, SSE bytes) in engine order; kind 'first' marks the first token.

    The kinds let the I/O layer pace output (prefill before 'first', TPOT before each
    'token', a 'skip' is a token that sends nothing) and inject transport faults without
    this function knowing about time.
    """
    if plan.stream_error is not None:
        yield "error", _sse(plan.stream_error.envelope())
        yield "done", b"data: [DONE]\n\n"
        return
    step_no = 0
    for kind, chunk in _events(plan):
        if kind != "token":
            yield kind, _sse(chunk) if chunk is not None else b""
            continue
        label = "first" if step_no == 0 else "token"
        step_no += 1
        if chunk is None:
            yield ("first" if label == "first" else "skip"), b""
            continue
        for choice in chunk["choices"]:
            ids = choice.get("token_ids")
            if ids is not None:
                choice["token_ids"] = _bad_ids(plan, ids)
            if plan.fault == "omit-token-ids" and step_no == 3:
                choice.pop("token_ids", None)
            if plan.chat and step_no == 2:
                if plan.fault == "audio":
                    choice["delta"]["audio"] = {"id": "audio-1", "data": "AAAA", "transcript": "x",
                                                "expires_at": 0}
                elif plan.fault == "annotations":
                    choice["delta"]["annotations"] = [
                        {"type": "url_citation", "url_citation": {"url": "http://x"}}]
        yield label, _sse(chunk)
        if plan.fault == "error-event" and step_no == 3:
            yield "error", _sse({"error": {"message": "simulated engine failure",
                                           "type": "InternalServerError", "param": None,
                                           "code": 500}})
            yield "done", b"data: [DONE]\n\n"
            return
        if plan.fault == "abrupt-close" and step_no == 3:
            yield "abort", b""
            return
        if plan.fault in FILLERS and step_no == 3:
            # After the third token, bytes that carry nothing: four MiB of blank lines, of
            # SSE comments 4 KiB long (a broken engine, or a proxy padding the stream), or
            # of events without output.
            line = FILLERS[plan.fault]
            yield "filler", line * (FILLER_BYTES // len(line))
        if plan.fault == "cut-short" and step_no == 3:
            # The body ends cleanly mid-answer, as a close-delimited body does when the
            # engine dies, or a proxy in front of it ends a chunked body on its timeout:
            # no finish_reason, no usage, no [DONE], and no transport error either.
            return
        if plan.fault == "stall" and step_no == 3:
            yield "stall", b""  # the engine hangs: no more bytes, the connection stays open
        if plan.fault == "keepalive" and step_no == 3:
            # It hangs too, but something in front of it keeps the stream alive with SSE
            # comments (as some proxies do): bytes, never a token.
            yield "keepalive", b""
    yield "done", b"data: [DONE]\n\n"
    if plan.fault == "linger":
        yield "stall", b""  # the answer is whole, but the body stays open after [DONE]


def full_response(plan: Plan) -> dict[str, Any]:
    """The non-streaming response vLLM returns for the same plan."""
    if plan.stream_error is not None:
        raise plan.stream_error
    vllm = plan.dialect == "vllm"
    ids = plan.return_token_ids
    choices: list[dict[str, Any]] = []
    for index, toks in enumerate(plan.choices):
        choice: dict[str, Any] = {"index": index}
        token_ids = [t.id for t in toks]
        if plan.chat:
            deltas = [d for t in toks if (d := _delta(plan, index, t)) is not None]
            content = "".join(d.get("content") or "" for d in deltas)
            refusal = "".join(d.get("refusal") or "" for d in deltas)
            msg: dict[str, Any] = {"role": "assistant", "content": content or None,
                                   "refusal": refusal or None, "annotations": None,
                                   "audio": None, "function_call": None}
            calls: dict[int, dict[str, Any]] = {}
            for d in deltas:
                for tc in d.get("tool_calls") or ():
                    cur = calls.setdefault(tc["index"], {"id": None, "type": "function",
                                                         "function": {"name": None,
                                                                      "arguments": ""}})
                    cur["id"] = tc.get("id", cur["id"])
                    fn = tc["function"]
                    cur["function"]["name"] = fn.get("name", cur["function"]["name"])
                    cur["function"]["arguments"] += fn.get("arguments", "")
            if calls:
                msg["tool_calls"] = [calls[k] for k in sorted(calls)]
                msg["content"] = content
            fn_parts = [d["function_call"] for d in deltas if "function_call" in d]
            if fn_parts:
                msg["function_call"] = {"name": "legacy_fn",
                                        "arguments": "".join(f["arguments"] for f in fn_parts)}
            if plan.reasoning != "none":
                reasoning = "".join(t.piece for t in toks if t.kind == "reasoning")
                shown = reasoning if plan.include_reasoning else ""
                for key in ("reasoning", "reasoning_content"):
                    if plan.reasoning in (key, "both"):
                        msg[key] = shown or None
                if plan.reasoning == "reasoning_content":
                    msg["reasoning"] = None
            else:
                msg["reasoning"] = None
            choice["message"] = msg
            entries = [_chat_logprob_entry(plan, t) for t in toks
                       if t.kind in ("content", "refusal")] if plan.logprobs else None
            if entries is not None:
                key = "refusal" if plan.output == "refusal" else "content"
                choice["logprobs"] = {key: entries}
            else:
                choice["logprobs"] = None
        else:
            text = "".join(t.piece for t in toks)
            if plan.echo and not ids:
                text = plan.prompt_text + text
            choice["text"] = text
            if plan.logprobs:
                lp: dict[str, list[Any]] = {"text_offset": [], "token_logprobs": [], "tokens": [],
                                            "top_logprobs": []}
                offset = len(plan.prompt_text) if plan.echo and not ids else 0
                for t in toks:
                    for key, values in _text_logprobs(plan, t, offset).items():
                        lp[key].extend(values)
                    offset += len(t.piece)
                choice["logprobs"] = lp
            else:
                choice["logprobs"] = None
        choice["finish_reason"] = plan.finish[index]
        if vllm:
            choice["stop_reason"] = plan.stop_reasons[index]
            choice["token_ids"] = token_ids if ids else None
            if not plan.chat:
                choice["prompt_logprobs"] = None
                choice["prompt_token_ids"] = plan.prompt_token_ids if ids else None
        choices.append(choice)
    resp: dict[str, Any] = {"id": plan.request_id,
                            "object": "chat.completion" if plan.chat else "text_completion",
                            "created": plan.created, "model": plan.model, "choices": choices}
    if vllm:
        resp["service_tier"] = None
        resp["system_fingerprint"] = SYSTEM_FINGERPRINT
    usage = _usage(plan)
    if vllm:
        usage.setdefault("prompt_tokens_details", None)
        usage.setdefault("completion_tokens_details", None)
    resp["usage"] = usage
    if vllm and plan.chat:
        resp["prompt_logprobs"] = None
        resp["prompt_token_ids"] = plan.prompt_token_ids if ids else None
        resp["prompt_text"] = None
    return resp

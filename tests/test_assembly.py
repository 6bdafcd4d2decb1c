from __future__ import annotations

import orjson
import pytest

from narwhal.core.assembly import Assembler
from narwhal.core.meter import EngineOutputError

USAGE = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}


def ev(*choices, **top):
    return {"id": "c1", "created": 5, "model": "m", "choices": list(choices)} | top


def ch(delta=None, index=0, **kw):
    return {"index": index, "delta": delta or {}} | kw


def assemble(events, chat=True, expose=False):
    a = Assembler(chat, expose)
    for e in events:
        a.feed(e)
    return orjson.loads(a.body(USAGE))


def test_strings_concatenate_under_their_keys():
    r = assemble([ev(ch({"role": "assistant", "content": ""})),
                  ev(ch({"content": "a", "reasoning": "r1", "reasoning_content": "x"})),
                  ev(ch({"content": "b", "reasoning": "r2", "refusal": "no"})),
                  ev(ch({}, finish_reason="stop"))])
    msg = r["choices"][0]["message"]
    assert (msg["content"], msg["reasoning"], msg["reasoning_content"], msg["refusal"]) == (
        "ab", "r1r2", "x", "no")
    assert r["object"] == "chat.completion" and r["id"] == "c1" and r["usage"] == USAGE


def test_tool_calls_grouped_by_index_in_index_order():
    r = assemble([
        ev(ch({"tool_calls": [{"index": 1, "id": "B", "type": "function",
                               "function": {"name": "second", "arguments": "{"}}]})),
        ev(ch({"tool_calls": [{"index": 0, "id": "A", "function": {"name": "fir",
                                                                   "arguments": "["}}]})),
        ev(ch({"tool_calls": [{"index": 0, "function": {"name": "st", "arguments": "]"}},
                              {"index": 1, "function": {"arguments": "}"}}]})),
        ev(ch({}, finish_reason="tool_calls"))])
    calls = r["choices"][0]["message"]["tool_calls"]
    assert calls == [
        {"id": "A", "type": "function", "function": {"name": "first", "arguments": "[]"}},
        {"id": "B", "type": "function", "function": {"name": "second", "arguments": "{}"}}]


def test_repeated_tool_id_and_name_are_not_doubled():
    r = assemble([ev(ch({"tool_calls": [{"index": 0, "id": "A", "function": {"name": "f",
                                                                             "arguments": "1"}}]})),
                  ev(ch({"tool_calls": [{"index": 0, "id": "A", "function": {"name": "f",
                                                                             "arguments": "2"}}]})),
                  ev(ch({}, finish_reason="tool_calls"))])
    assert r["choices"][0]["message"]["tool_calls"][0] == {
        "id": "A", "type": "function", "function": {"name": "f", "arguments": "12"}}


@pytest.mark.parametrize("missing", ["id", "name"])
def test_tool_call_needs_id_and_name(missing):
    call = {"index": 0, "id": "A", "function": {"name": "f", "arguments": "{}"}}
    if missing == "id":
        del call["id"]
    else:
        del call["function"]["name"]
    with pytest.raises(EngineOutputError):
        assemble([ev(ch({"tool_calls": [call]})), ev(ch({}, finish_reason="tool_calls"))])


def test_legacy_function_call():
    r = assemble([ev(ch({"function_call": {"name": "f", "arguments": "{"}})),
                  ev(ch({"function_call": {"arguments": "}"}}, finish_reason="function_call"))])
    assert r["choices"][0]["message"]["function_call"] == {"name": "f", "arguments": "{}"}


def test_chat_logprobs_concatenate():
    r = assemble([ev(ch({"content": "a"}, logprobs={"content": [{"token": "a"}], "refusal": None})),
                  ev(ch({"refusal": "n"}, logprobs={"refusal": [{"token": "n"}]})),
                  ev(ch({"content": "b"}, logprobs={"content": [{"token": "b"}]},
                        finish_reason="stop"))])
    assert r["choices"][0]["logprobs"] == {"content": [{"token": "a"}, {"token": "b"}],
                                           "refusal": [{"token": "n"}]}


def test_text_logprobs_concatenate():
    lp = lambda t, o: {"tokens": [t], "token_logprobs": [-1.0], "text_offset": [o],  # noqa: E731
                       "top_logprobs": [{t: -1.0}]}
    r = assemble([ev({"index": 0, "text": "a", "logprobs": lp("a", 0)}),
                  ev({"index": 0, "text": "b", "logprobs": lp("b", 1), "finish_reason": "length",
                      "stop_reason": None})], chat=False)
    c = r["choices"][0]
    assert c["text"] == "ab" and c["logprobs"]["tokens"] == ["a", "b"]
    assert c["logprobs"]["text_offset"] == [0, 1] and c["stop_reason"] is None
    assert r["object"] == "text_completion"


def test_finish_and_stop_reason_survive_usage_only_frames():
    r = assemble([ev(ch({"content": "a"}, finish_reason="stop", stop_reason="</s>")),
                  ev(usage={"prompt_tokens": 1})])
    c = r["choices"][0]
    assert (c["finish_reason"], c["stop_reason"]) == ("stop", "</s>")


def test_stop_reason_absent_when_engine_never_sent_it():
    r = assemble([ev(ch({"content": "a"}, finish_reason="stop"))])
    assert "stop_reason" not in r["choices"][0]


def test_multiple_choices_assemble_independently():
    r = assemble([ev(ch({"content": "x"}, index=1), ch({"content": "y"}, index=0)),
                  ev(ch({}, index=0, finish_reason="stop"), ch({}, index=1, finish_reason="length"))])
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in r["choices"]] == [
        (0, "y", "stop"), (1, "x", "length")]


def test_token_ids_exposed_only_on_request():
    events = [ev(ch({"content": "a"}, token_ids=[1, 2]), prompt_token_ids=[9]),
              ev(ch({}, finish_reason="stop", token_ids=[]))]
    shown = assemble(events, expose=True)
    assert shown["choices"][0]["token_ids"] == [1, 2] and shown["prompt_token_ids"] == [9]
    hidden = assemble(events)
    assert "token_ids" not in hidden["choices"][0] and "prompt_token_ids" not in hidden


def test_metadata_kept():
    r = assemble([ev(ch({"content": "a"}), system_fingerprint="fp", service_tier=None),
                  ev(ch({}, finish_reason="stop"))])
    assert r["system_fingerprint"] == "fp" and r["model"] == "m" and r["created"] == 5


@pytest.mark.parametrize("event", [
    ev(ch({"audio": {"id": "a"}})),
    ev(ch({"annotations": [{"type": "url_citation"}]})),
    ev(ch({"tool_calls": [{"index": 0, "type": "custom", "custom": {"input": "x"}}]})),
    ev(ch({"content": "a"}, new_field=1)),
])
def test_unsupported_fields_with_a_value(event):
    with pytest.raises(EngineOutputError, match="unsupported"):
        assemble([event])


def test_unsupported_fields_without_a_value_are_fine():
    r = assemble([ev(ch({"content": "a", "audio": None, "annotations": []})),
                  ev(ch({}, finish_reason="stop"))])
    assert r["choices"][0]["message"]["content"] == "a"


@pytest.mark.parametrize("event", [
    ev(ch({"content": 5})),
    ev(ch({"tool_calls": {"index": 0}})),
    ev(ch({"tool_calls": [{"id": "x"}]})),
    ev(ch({"tool_calls": [{"index": 0, "function": {"arguments": 1}}]})),
    ev(ch({"function_call": "f"})),
    ev(ch({"content": "a"}, logprobs={"content": "x"})),
    ev(ch({"content": "a"}, index=-1)),
    ev(ch({}, finish_reason=3)),
])
def test_malformed_supported_fields(event):
    with pytest.raises(EngineOutputError, match="malformed"):
        assemble([event, ev(ch({}, finish_reason="stop"))])


@pytest.mark.parametrize("many, message", [
    (lambda i: ev(ch({"content": "x"}, index=i)), "more than 128 choices"),
    (lambda i: ev(ch({"tool_calls": [{"index": i, "id": "a", "function": {"name": "f"}}]})),
     "more than 128 tool calls"),
    (lambda i: ev(ch({"content": "x"}), **{f"field{i}": 1}), "more than 256 top-level"),
])
def test_what_an_assembly_holds_apart_from_its_text_is_counted(many, message):
    """Each new choice, tool call or metadata field is an object of hundreds of bytes made
    from a few bytes of an event: counted, so that an engine's events cannot make one
    response hold several times the response bound; up to the count they assemble."""
    a = Assembler(True, False)
    for i in range(100):
        a.feed(many(i))
    with pytest.raises(EngineOutputError, match=message):
        for i in range(100, 300):
            a.feed(many(i))


def test_stream_without_finish_reason_is_malformed():
    with pytest.raises(EngineOutputError, match="finish_reason"):
        assemble([ev(ch({"content": "a"}))])


def test_many_tool_id_fragments_are_linear():
    """60k id fragments once stalled the loop for 12 s (each compared with the joined id)."""
    import time

    a = Assembler(True, False)
    start = time.process_time()
    for i in range(60_000):
        a.feed(ev(ch({"tool_calls": [{"index": 0, "id": "ab"[i % 2],
                                      "function": {"name": "f" if i == 0 else ""}}]})))
    assert time.process_time() - start < 3.0
    a.feed(ev(ch({}, finish_reason="tool_calls")))
    call = orjson.loads(a.body(USAGE))["choices"][0]["message"]["tool_calls"][0]
    assert len(call["id"]) == 60_000


@pytest.mark.parametrize("bad", [5, "1,2", {"a": 1}])
def test_non_list_token_ids_are_a_malformed_output(bad):
    with pytest.raises(EngineOutputError):
        assemble([ev(ch({"content": "a"}, token_ids=bad)), ev(ch({}, finish_reason="stop"))],
                 expose=True)


def test_arrays_sent_in_parts_join_in_order_across_blocks():
    """Token IDs and logprobs are held as JSON text, joined into blocks as they come (64
    parts a block): order, empty parts and the blocks' seams are as the engine sent them."""
    events = [ev(ch({"content": "x"}, token_ids=[i] if i % 7 else [],
                    logprobs={"content": [{"token": str(i), "logprob": -i / 3}]}))
              for i in range(200)]
    r = assemble([*events, ev(ch({}, finish_reason="stop"))], expose=True)
    c = r["choices"][0]
    assert c["token_ids"] == [i for i in range(200) if i % 7]
    assert c["logprobs"] == {"content": [{"token": str(i), "logprob": -i / 3} for i in range(200)]}
    empty = assemble([ev(ch({"content": "x"}, logprobs={"content": []}, finish_reason="stop"))])
    assert empty["choices"][0]["logprobs"] == {"content": []}


def test_what_an_engine_sends_is_held_at_about_its_bytes():
    """Parsed, 16 MiB of events held 80 MiB of logprobs objects and 118 MiB of token IDs
    (measured): an engine's output, through logprobs or IDs a client asks for, made one
    response hold several times the response bound. Held as JSON text, about its bytes."""
    import tracemalloc

    top = [{"token": f"t{j}", "logprob": -1.25 * j, "bytes": [116, 49]} for j in range(20)]
    kinds = {
        "logprobs": lambda i: ev(ch({"content": "t"}, token_ids=[1000 + i], logprobs={
            "content": [{"token": "t", "logprob": -0.5, "bytes": [116], "top_logprobs": top}]})),
        "token IDs": lambda i: ev(ch({"content": "t"}, token_ids=list(range(i, i + 4000)))),
        "metadata": lambda i: ev(ch({"content": "t"}), **{f"f{i}": [list(range(500))] * 8}),
    }
    for kind, make in kinds.items():
        a = Assembler(True, True)
        raw = [orjson.dumps(make(i)) for i in range(200)]
        tracemalloc.start()
        for r in raw:
            a.feed(orjson.loads(r))
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        sent = sum(map(len, raw))
        assert held < 1.5 * sent, (kind, held / sent)


@pytest.mark.parametrize("piece", ["a", " the", "\u00e9", "\U0001f600"])
@pytest.mark.parametrize("kind", ["content", "reasoning_content", "arguments", "text"])
def test_text_in_pieces_is_held_and_counted_at_about_its_bytes(kind, piece):
    """Text arrives a token at a time. Held as a string per piece, 90,000 one-character
    deltas (88 KiB of text) held 5.6 MiB, counted against serving.max_held_bytes as 88 KiB:
    the budget saw 1.5% of it. Joined into blocks as it comes, a response holds at most
    twice its text, and ``held`` counts what it holds."""
    import tracemalloc

    def make(i: int) -> dict:
        if kind == "text":
            return ev({"index": 0, "text": piece})
        if kind == "arguments":
            call: dict = {"index": 0, "function": {"arguments": piece}}
            if i == 0:
                call |= {"id": "call_0", "type": "function",
                         "function": {"name": "f", "arguments": piece}}
            return ev(ch({"tool_calls": [call]}))
        return ev(ch({kind: piece}))

    n = 20_000
    raw = [orjson.dumps(make(i)) for i in range(n)]
    a = Assembler(kind != "text", False)
    tracemalloc.start()
    for r in raw:
        a.feed(orjson.loads(r))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    top = ord(max(piece))
    width = 4 if top > 0xFFFF else 2 if top > 0xFF else 1  # CPython's bytes a character
    chars = n * len(piece)
    assert held < 2 * chars * width + 16_384, held / chars
    assert 0.8 * held < a.held < 1.25 * held, (a.held, held)
    a.feed(ev(ch({}, finish_reason="stop")) if kind != "text"
           else ev({"index": 0, "finish_reason": "stop"}))
    out = orjson.loads(a.body(USAGE))["choices"][0]
    got = {"text": lambda: out["text"],
           "arguments": lambda: out["message"]["tool_calls"][0]["function"]["arguments"]
           }.get(kind, lambda: out["message"][kind])()
    assert got == piece * n


@pytest.mark.parametrize("chat", [True, False])
def test_each_choice_and_tool_call_is_counted_at_what_it_holds(chat):
    """Within MAX_CHOICES and MAX_TOOL_CALLS, an engine naming a new choice and tool call
    in each event made a response hold 8.2 MB of objects from 1.9 MB of events, counted
    0.05 MB against serving.max_held_bytes. Each is counted as it comes."""
    import tracemalloc

    def call(c: int, k: int) -> dict:
        return ev(ch({"tool_calls": [{"index": k, "id": "i", "type": "function",
                                      "function": {"name": "f", "arguments": "a"}}]},
                     index=c))

    raw = [orjson.dumps(call(c, k) if chat else ev({"index": c, "text": "a"}))
           for c in range(128) for k in range(128 if chat else 1)]
    a = Assembler(chat, False)
    tracemalloc.start()
    for r in raw:
        a.feed(orjson.loads(r))
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert 0.8 * held < a.held < 1.25 * held, (a.held, held)


@pytest.mark.parametrize("where", ["metadata", "logprobs", "stop_reason", "usage"])
def test_output_nested_past_what_json_writes_is_malformed(where):
    """orjson reads 1,024 levels and writes 254: such output was an exception at the
    response's end (a 500); it is the engine's malformed output (a 502) when it comes."""
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    event = {"metadata": ev(ch({"content": "a"}), extra=deep),
             "logprobs": ev(ch({"content": "a"}, logprobs={"content": [deep]})),
             "stop_reason": ev(ch({"content": "a"}, finish_reason="stop", stop_reason=deep)),
             "usage": ev(ch({"content": "a"}))}[where]
    a = Assembler(True, False)
    with pytest.raises(EngineOutputError, match="nested deeper than 254"):
        a.feed(event)
        a.feed(ev(ch({}, finish_reason="stop")))
        a.body({"prompt_tokens": deep} if where == "usage" else USAGE)


def test_the_reply_is_the_first_choices_text_and_is_bounded():
    """What the prefix index learns of an assembled response: its content (a completion's
    text), as a stream's ``ReplyText`` collects it, at most REPLY_MAX_BYTES."""
    from narwhal.core.prefix import REPLY_MAX_BYTES

    chat = Assembler(True, False)
    for e in (ev(ch({"role": "assistant", "content": ""})), ev(ch({"content": "Hello"})),
              ev(ch({"reasoning_content": "hmm"})), ev(ch({"content": " world"}))):
        chat.feed(e)
    assert chat.reply() == "Hello world"
    assert Assembler(True, False).reply() == ""
    text = Assembler(False, False)
    text.feed(ev({"index": 0, "text": "a"}))
    assert text.reply() == "a"
    big = Assembler(True, False)
    for _ in range(3 * REPLY_MAX_BYTES // 1000):
        big.feed(ev(ch({"content": "x" * 1000})))
    assert big.reply() == "x" * REPLY_MAX_BYTES

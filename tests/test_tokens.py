from __future__ import annotations

import pytest

from narwhal.core.meter import FREE_EMPTY_EVENTS, EngineOutputError, Meter
from narwhal.core.relay import Relay
from narwhal.core.tokens import TokenIdError, count_token_ids


@pytest.mark.parametrize("ids", [None, "1,2", [True], [1, False], [-1], [1.0], ["1"], {"a": 1}])
def test_invalid_id_lists(ids):
    with pytest.raises(TokenIdError):
        count_token_ids(ids)


def test_valid_ids_counted():
    assert count_token_ids([0, 5, 7]) == 3
    assert count_token_ids([]) == 0


def delta_event(delta, **kw):
    return {"choices": [{"index": 0, "delta": delta} | kw]}


@pytest.mark.parametrize("delta", [{"content": "a"}, {"reasoning": "r"}, {"refusal": "n"},
                                   {"reasoning_content": "r"},
                                   {"tool_calls": [{"index": 0, "function": {"arguments": "x"}}]}])
def test_generation_events_need_ids(delta):
    m = Meter(chat=True, token_ids=True)
    with pytest.raises(TokenIdError):
        m.observe(delta_event(delta))
    assert m.observe(delta_event(delta, token_ids=[4, 5])) == 2
    assert m.output_tokens == 2 and m.first_token_seen


def test_role_and_finish_events_need_no_ids():
    m = Meter(chat=True, token_ids=True)
    assert m.observe(delta_event({"role": "assistant", "content": ""})) == 0
    assert m.observe(delta_event({}, finish_reason="stop")) == 0
    assert not m.first_token_seen


def test_boolean_id_on_non_generating_event_still_fails():
    with pytest.raises(TokenIdError):
        Meter(chat=True, token_ids=True).observe(delta_event({}, token_ids=[True]))


def test_text_completion_events():
    m = Meter(chat=False, token_ids=True)
    with pytest.raises(TokenIdError):
        m.observe({"choices": [{"index": 0, "text": "a"}]})
    assert m.observe({"choices": [{"index": 0, "text": "a", "token_ids": [1]}]}) == 1


def test_dialect_without_ids_counts_events():
    m = Meter(chat=True, token_ids=False)
    m.observe(delta_event({"content": "a"}))
    m.observe(delta_event({"content": "b"}))
    assert m.output_tokens == 2


def test_error_event_and_shape_errors():
    m = Meter(chat=True, token_ids=True)
    with pytest.raises(EngineOutputError, match="boom"):
        m.observe({"error": {"message": "boom"}})
    with pytest.raises(EngineOutputError):
        m.observe([1])
    with pytest.raises(EngineOutputError):
        m.observe({"choices": "x"})


def test_usage_and_prompt_ids_recorded():
    m = Meter(chat=True, token_ids=True)
    m.observe({"choices": [], "usage": {"prompt_tokens": 3}, "prompt_token_ids": [1, 2, 3]})
    assert m.usage == {"prompt_tokens": 3} and m.prompt_token_ids == 3


def test_usage_is_kept_at_about_its_bytes_and_bounded():
    """Usage is kept until the response ends: its counts as numbers, its objects as JSON
    text (written back as they came), at most 64 fields, nothing past 254 levels."""
    import orjson

    m = Meter(chat=True, token_ids=True)
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
             "prompt_tokens_details": {"cached_tokens": 1}}
    m.observe({"choices": [], "usage": usage})
    assert m.usage["prompt_tokens"] == 3 and m.output_tokens == 0
    assert orjson.loads(orjson.dumps(m.usage)) == usage
    assert isinstance(m.usage["prompt_tokens_details"], orjson.Fragment)
    with pytest.raises(EngineOutputError, match="more than 64 fields"):
        m.observe({"choices": [], "usage": {f"k{i}": i for i in range(65)}})
    deep: object = 1
    for _ in range(300):
        deep = [deep]
    with pytest.raises(EngineOutputError, match="nested deeper than 254"):
        m.observe({"choices": [], "usage": {"prompt_tokens": 1, "x": deep}})


def test_relay_nulls_ids_and_drops_unrequested_usage():
    r = Relay(expose_ids=False, include_usage=False)
    ev = {"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [1]}],
          "prompt_token_ids": [2]}
    assert r.event(ev, b"raw") == (b'data: {"choices":[{"index":0,"delta":{"content":"a"},'
                                   b'"token_ids":null}],"prompt_token_ids":null}\n\n')
    assert r.event({"choices": [], "usage": {"x": 1}}, b"raw") is None


def test_relay_drops_events_that_only_carried_ids():
    r = Relay(expose_ids=False, include_usage=True)
    assert r.event({"choices": [{"index": 0, "delta": {}, "token_ids": [7]}]}, b"raw") is None
    assert r.event({"choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [7]}]},
                   b"raw") is not None
    assert r.event({"choices": [{"index": 0, "text": "", "token_ids": [7]}]}, b"raw") is not None
    kept = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": [7]}]}
    assert r.event(kept, b"raw") is not None


def test_relay_moves_usage_metadata_onto_the_final_event():
    r = Relay(expose_ids=True, include_usage=False)
    final = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    assert r.event(final, b"raw") is None  # held until the usage frame
    out = r.event({"id": "c", "choices": [], "usage": {"completion_tokens": 1},
                   "system_fingerprint": "fp"}, b"raw")
    assert out == (b'data: {"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"length"}],'
                   b'"system_fingerprint":"fp"}\n\n')
    assert r.flush() is None


def test_relay_flushes_a_held_event_without_usage():
    r = Relay(expose_ids=True, include_usage=False)
    assert r.event({"choices": [{"index": 0, "finish_reason": "stop"}]}, b"raw") is None
    assert r.flush() == b'data: {"choices":[{"index":0,"finish_reason":"stop"}]}\n\n'


def test_ids_on_events_without_visible_output_are_counted():
    """vLLM sends tool-call markup, partial UTF-8 and special tokens with an empty delta."""
    m = Meter(chat=True, token_ids=True)
    assert m.observe(delta_event({}, token_ids=[5])) == 1
    assert m.observe(delta_event({"reasoning": ""}, token_ids=[6, 7])) == 2
    assert m.observe(delta_event({"content": "x"}, token_ids=[8])) == 1
    assert m.output_tokens == 4 and m.first_token_seen


def test_completion_prompt_ids_per_choice():
    m = Meter(chat=False, token_ids=True)
    m.observe({"choices": [{"index": 0, "text": "a", "token_ids": [1],
                            "prompt_token_ids": [4, 5, 6]}]})
    assert m.prompt_token_ids == 3


def test_without_ids_the_engine_usage_is_the_count():
    m = Meter(chat=True, token_ids=False)
    assert m.observe(delta_event({"content": "a"}, token_ids=None)) == 1
    assert m.observe(delta_event({}, token_ids=None)) == 0
    assert m.output_tokens == 1
    m.observe({"choices": [], "usage": {"completion_tokens": 9}})
    assert m.output_tokens == 9


def test_error_event_keeps_the_engine_envelope():
    from narwhal.core.meter import EngineErrorEvent

    m = Meter(chat=True, token_ids=True)
    with pytest.raises(EngineErrorEvent) as info:
        m.observe({"error": {"message": "no", "code": 400, "param": "logprobs"}}, b"raw")
    assert info.value.status == 400 and info.value.raw == b"raw"
    with pytest.raises(EngineErrorEvent) as info:
        m.observe({"error": {"message": "no", "code": True}})
    assert info.value.status == 502


def test_relay_verbatim_when_client_asked_for_everything():
    r = Relay(expose_ids=True, include_usage=True)
    assert r.event({"choices": []}, b'{"raw":1}') == b'data: {"raw":1}\n\n'


def test_relay_keeps_ids_when_requested():
    r = Relay(expose_ids=True, include_usage=False)
    # Nothing to strip: the engine's bytes go out unchanged, IDs included.
    assert r.event({"choices": [{"index": 0, "token_ids": [1]}]}, b"raw") == b"data: raw\n\n"


@pytest.mark.parametrize("token_ids", [True, False])
def test_events_without_output_are_bounded_whatever_the_tokens(token_ids):
    """An answer has a few events without output (role, finish_reason, usage). Past
    FREE_EMPTY_EVENTS of them it fails, however many tokens came: 4 MiB of
    ``{"choices":[]}`` cost ~0.3 s to parse and were relayed whole. The check runs only
    on events without tokens, off a token event's path."""
    meter = Meter(chat=True, token_ids=token_ids, max_tokens=10_000)
    token = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [7]}]}
    empty = {"choices": []}
    for _ in range(3000):
        assert meter.observe(token) == 1
    for _ in range(FREE_EMPTY_EVENTS):
        assert meter.observe(empty) == 0
    with pytest.raises(EngineOutputError, match=f"over {FREE_EMPTY_EVENTS} events without out"):
        meter.observe(empty)
    assert meter.output_tokens == 3000

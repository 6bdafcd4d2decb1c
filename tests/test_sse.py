from __future__ import annotations

import pytest

from narwhal.core.sse import SSEError, SSEParser

STREAM = (b': keep-alive\n\ndata: {"a": 1}\n\nevent: x\ndata: {"b":\ndata: 2}\r\n\r\n'
          b"id: 7\ndata: [DONE]\n\n")
EXPECTED = [b'{"a": 1}', b'{"b":\n2}', b"[DONE]"]


def test_whole_stream():
    assert SSEParser().feed(STREAM) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_every_two_way_split(cut):
    p = SSEParser()
    assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) + p.close() == EXPECTED


def test_byte_by_byte():
    p = SSEParser()
    out = []
    for i in range(len(STREAM)):
        out += p.feed(STREAM[i:i + 1])
    assert out == EXPECTED


def test_final_event_without_blank_line_counts_at_close():
    p = SSEParser()
    assert p.feed(b"data: tail") == []
    assert p.close() == [b"tail"]


def test_oversized_event_is_refused():
    p = SSEParser(max_event_bytes=16)
    with pytest.raises(SSEError):
        p.feed(b"data: " + b"x" * 40)


def test_utf8_split_inside_a_character():
    raw = 'data: {"c": "né"}\n\n'.encode()
    cut = raw.index("é".encode()) + 1
    p = SSEParser()
    assert p.feed(raw[:cut]) + p.feed(raw[cut:]) == ['{"c": "né"}'.encode()]

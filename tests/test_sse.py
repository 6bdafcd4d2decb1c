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


def test_event_size_bound_is_the_same_however_chunked():
    stream = b"data: " + b"x" * 10 + b"\ndata: " + b"y" * 10 + b"\n\n"
    for size in (1, 3, 7, len(stream)):
        p = SSEParser(max_event_bytes=33)  # the event's raw bytes: 34
        with pytest.raises(SSEError):
            for i in range(0, len(stream), size):
                p.feed(stream[i:i + size])
        p = SSEParser(max_event_bytes=34)
        out = []
        for i in range(0, len(stream), size):
            out += p.feed(stream[i:i + size])
        assert out == [b"x" * 10 + b"\n" + b"y" * 10]


def test_many_data_lines_are_linear():
    """520k one-byte data lines (3.6 MB) used to stall the loop for seconds."""
    import time

    p = SSEParser(max_event_bytes=5_000_000)
    stream = b"data: x\n" * 520_000 + b"\n"
    start = time.process_time()
    (event,) = p.feed(stream)
    assert len(event) == 2 * 520_000 - 1
    assert time.process_time() - start < 2.0  # quadratic joining took 26 s here


def test_a_line_in_one_byte_chunks_is_linear():
    import time

    p = SSEParser(max_event_bytes=600_000)
    start = time.process_time()
    for _ in range(500_000):
        p.feed(b"x")
    assert time.process_time() - start < 2.0
    with pytest.raises(SSEError):
        p.feed(b"y" * 200_000)


@pytest.mark.parametrize("shape", ["two-byte lines", "a line in two-byte chunks"])
def test_an_event_held_in_pieces_takes_about_its_bytes(shape):
    """An event still arriving is counted at its raw bytes (``held``) against
    serving.max_held_bytes; as a list of bytes objects, one a line or a chunk, it took
    5x (two-byte data lines) to 40x (two-byte chunks of one line) of them. Folded into
    one buffer past PIECES pieces, about its bytes; the event is the same."""
    import tracemalloc

    line = b"xy" * 250_000
    p = SSEParser(1_048_576)
    tracemalloc.start()
    if shape == "two-byte lines":
        assert p.feed(b"data:ab\n" * 120_000) == []
    else:
        assert p.feed(b"data: {") == []
        for i in range(0, len(line), 2):  # each chunk a new object, as each message's is
            assert p.feed(line[i:i + 2]) == []
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert held < 1.25 * p.held() + 16_384, (held, p.held())
    (event,) = p.feed(b"\n\n")
    expected = b"\n".join([b"ab"] * 120_000) if shape == "two-byte lines" else b"{" + b"xy" * 250_000
    assert event == expected and type(event) is bytes

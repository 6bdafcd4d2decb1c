from __future__ import annotations

import pytest

from narwhal.core.sse import FREE_LINES, MIN_LINE_BYTES, SSEError, SSEParser

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
    """520k one-byte data lines (3.6 MB) used to stall the loop for seconds (with the
    line bound lifted: it refuses them now, next test)."""
    import time

    p = SSEParser(max_event_bytes=5_000_000, free_lines=10**9)
    stream = b"data: x\n" * 520_000 + b"\n"
    start = time.process_time()
    (event,) = p.feed(stream)
    assert len(event) == 2 * 520_000 - 1
    assert time.process_time() - start < 2.0  # quadratic joining took 26 s here


@pytest.mark.parametrize("filler", [b"\n", b":\n\n", b"data: x\n", b"event: e\n\n",
                                    b": keep-alive\r\n\r\n"])
def test_lines_under_the_minimum_on_average_fail_before_the_loop_parses_them(filler):
    """Past FREE_LINES, lines must bring MIN_LINE_BYTES on average: four MiB of blank
    lines cost the router 1.7 s through Envoy. The count is taken in C before the loop,
    so the chunk that overdraws fails without being parsed; the free lines parse."""
    import time

    p = SSEParser()
    assert p.feed(filler * (FREE_LINES // filler.count(b"\n"))) == []
    start = time.process_time()
    with pytest.raises(SSEError, match=f"under {MIN_LINE_BYTES} bytes on average "
                                       f"\\(past the first {FREE_LINES} lines\\)"):
        p.feed(filler * 500_000)
    assert time.process_time() - start < 0.05  # parsing them took ~0.2-0.5 s


def test_lines_of_token_events_leave_credit_for_keepalives_and_blank_lines():
    """Token events parsed in the loop (split across chunks) bring ~100-300 bytes a line:
    a stream of them may carry comments and blank lines beyond the free ones."""
    p = SSEParser()
    event = (b'data: {"id":"chatcmpl-8f3a2c","object":"chat.completion.chunk","created":'
             b'1733100000,"model":"narwhal-sim","choices":[{"index":0,"delta":{"content":'
             b'" tusk"},"logprobs":null,"finish_reason":null,"token_ids":[1042]}]}\n\n')  # vLLM's
    out = []
    for _ in range(2000):
        out += p.feed(event[:20])  # split: the line loop parses each
        out += p.feed(event[20:] + b": keep-alive\n\n")
    assert len(out) == 2000 and out[0] == event[6:-2]


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
    p = SSEParser(1_048_576, free_lines=10**9)  # two-byte lines: the line bound lifted
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

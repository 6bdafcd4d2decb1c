"""The sans-I/O HTTP/2 server connection, driven by h2 (python-hyper) as the peer."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import h2.settings
import pytest

from narwhal.server import http2

REQUEST = [(":method", "POST"), (":scheme", "http"), (":authority", "x"), (":path", "/svc/M"),
           ("content-type", "application/grpc")]


def pair(client_window: int = 65535):
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                  header_encoding="utf-8"))
    client.local_settings = h2.settings.Settings(client=True, initial_values={
        h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: client_window})
    client.initiate_connection()
    server = http2.ServerConnection(window=1 << 20)
    server.initiate()
    return client, server


def pump(client, server) -> tuple[list, list]:
    """Exchange bytes until both sides are quiet; return (server events, client events)."""
    s_events, c_events = [], []
    for _ in range(10):
        to_server = client.data_to_send()
        s_events += server.receive(to_server) if to_server else []
        to_client = server.data_to_send()
        c_events += client.receive_data(to_client) if to_client else []
        if not to_server and not to_client:
            break
    return s_events, c_events


def test_request_data_and_response():
    client, server = pair()
    pump(client, server)
    client.send_headers(1, REQUEST)
    client.send_data(1, b"hello", end_stream=True)
    s_events, _ = pump(client, server)
    req, data = s_events
    assert isinstance(req, http2.RequestReceived) and dict(req.headers)[b":path"] == b"/svc/M"
    assert isinstance(data, http2.DataReceived) and data.data == b"hello" and data.end_stream
    server.send_headers(1, [(b":status", b"200")])
    assert server.send_data(1, b"world") == 5
    server.send_headers(1, [(b"grpc-status", b"0")], end_stream=True)
    _, c_events = pump(client, server)
    kinds = [type(e) for e in c_events]
    assert h2.events.ResponseReceived in kinds and h2.events.TrailersReceived in kinds
    assert b"".join(e.data for e in c_events if isinstance(e, h2.events.DataReceived)) == b"world"
    assert any(isinstance(e, h2.events.StreamEnded) for e in c_events)


def test_flow_control_blocks_and_resumes():
    client, server = pair(client_window=10)
    pump(client, server)
    client.send_headers(1, REQUEST)
    pump(client, server)
    server.send_headers(1, [(b":status", b"200")])
    assert server.send_data(1, b"x" * 25) == 10
    assert server.send_window(1) == 0
    _, c_events = pump(client, server)
    got = sum(len(e.data) for e in c_events if isinstance(e, h2.events.DataReceived))
    client.acknowledge_received_data(got, 1)
    client.increment_flow_control_window(100, stream_id=1)
    s_events, _ = pump(client, server)
    assert any(isinstance(e, http2.WindowUpdated) and e.stream_id == 1 for e in s_events)
    assert server.send_data(1, b"x" * 15) == 15


def test_large_data_is_split_into_frames():
    client, server = pair(client_window=1 << 20)
    pump(client, server)
    client.send_headers(1, REQUEST)
    client.increment_flow_control_window(1 << 20)
    pump(client, server)
    server.send_headers(1, [(b":status", b"200")])
    body = bytes(range(256)) * 300  # 76,800 bytes > 16,384 max frame
    assert server.send_data(1, body) == len(body)
    _, c_events = pump(client, server)
    assert b"".join(e.data for e in c_events if isinstance(e, h2.events.DataReceived)) == body


def test_inbound_window_is_replenished_as_data_is_consumed():
    client, server = pair()
    pump(client, server)
    client.send_headers(1, REQUEST)
    total = 0
    for _ in range(100):  # 100 x 16 KiB = 1.6 MiB, beyond the 1 MiB window
        client.send_data(1, b"y" * 16384)
        total += 16384
        s_events, _ = pump(client, server)
        server.consumed(sum(len(e.data) for e in s_events if isinstance(e, http2.DataReceived)))
    assert total > 1 << 20  # h2 would have raised FlowControlError without updates


def test_unconsumed_data_holds_the_connection_window():
    """Received is not consumed: a peer cannot make the server hold more than its window."""
    client, server = pair()
    pump(client, server)
    client.send_headers(1, REQUEST)
    sent = 0
    for _ in range(100):
        n = min(16384, client.local_flow_control_window(1))
        if n == 0:
            break
        client.send_data(1, b"y" * n)
        sent += n
        pump(client, server)
    assert sent == 1 << 20  # exactly the window, nothing more
    server.consumed(sent)
    pump(client, server)
    assert client.local_flow_control_window(1) > 0


def test_ping_is_acknowledged():
    client, server = pair()
    pump(client, server)
    client.ping(b"12345678")
    _, c_events = pump(client, server)
    assert any(isinstance(e, h2.events.PingAckReceived) and e.ping_data == b"12345678"
               for e in c_events)


def test_reset_stream_event():
    client, server = pair()
    pump(client, server)
    client.send_headers(1, REQUEST)
    pump(client, server)
    client.reset_stream(1)
    s_events, _ = pump(client, server)
    assert [type(e) for e in s_events] == [http2.StreamReset]


def test_long_header_block_uses_continuation():
    client, server = pair()
    pump(client, server)
    big = [(f"x-big-{i}", "v" * 1000) for i in range(30)]  # ~30 KiB of headers
    client.send_headers(1, REQUEST + big, end_stream=True)
    s_events, _ = pump(client, server)
    (req,) = s_events
    assert len(req.headers) == len(REQUEST) + 30 and req.end_stream


def test_settings_change_adjusts_open_stream_windows():
    client, server = pair(client_window=100)
    pump(client, server)
    client.send_headers(1, REQUEST)
    pump(client, server)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 50})
    pump(client, server)
    assert server.send_window(1) == 50


def test_bad_preface_terminates():
    server = http2.ServerConnection()
    (ev,) = server.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(ev, http2.ConnectionTerminated) and ev.code == http2.PROTOCOL_ERROR


def test_oversized_frame_terminates_with_goaway():
    server = http2.ServerConnection()
    frame = (20000).to_bytes(3, "big") + b"\x00\x00" + (1).to_bytes(4, "big") + b"z" * 20000
    events = server.receive(http2.PREFACE + frame)
    assert events[-1].code == http2.FRAME_SIZE_ERROR
    out = server.data_to_send()
    assert out[3] == 7 and server.closed  # one GOAWAY frame, then nothing more is read
    assert server.receive(frame) == []


@pytest.mark.parametrize("cut", [1, 5, 9, 24, 30])
def test_frames_split_anywhere(cut):
    client, _ = pair()
    server = http2.ServerConnection()
    client.send_headers(1, REQUEST)
    client.send_data(1, b"abc", end_stream=True)
    raw = client.data_to_send()
    events = server.receive(raw[:cut]) + server.receive(raw[cut:])
    assert [type(e) for e in events] == [http2.RequestReceived, http2.DataReceived]


def test_a_remembered_header_block_is_decoded_again_once_the_table_changed() -> None:
    """Blocks that only read the dynamic table are remembered; the same bytes read after
    the table changed must see the new table (index 62 is the newest entry)."""
    from hpack import Encoder, HPACKError

    from narwhal.server.http2 import _Decoder

    enc, dec = Encoder(), _Decoder(65536)
    assert dec.decode(enc.encode([("x-a", "1")])) == [(b"x-a", b"1")]  # adds entry 62
    again = enc.encode([("x-a", "1")])  # a reference to entry 62: reads only
    assert dec.decode(again) == [(b"x-a", b"1")]
    assert dec.decode(again) == [(b"x-a", b"1")]  # remembered
    assert again in dec.blocks
    assert dec.decode(enc.encode([("x-b", "2")])) == [(b"x-b", b"2")]  # now entry 62
    assert dec.decode(again) == [(b"x-b", b"2")]
    dec.table.maxsize = 0  # a size update empties the table: nothing to refer to
    with pytest.raises(HPACKError):
        dec.decode(again)


def test_a_remembered_header_block_is_encoded_again_once_the_table_changed() -> None:
    """What the encoder remembers decodes, block after block, to what was sent, also
    after another header changed the table and after the peer resized it."""
    from hpack import Decoder

    from narwhal.server.http2 import _Encoder

    enc, dec = _Encoder(), Decoder()
    grpc = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    other = [(b"x-a", b"1")]
    for headers in (grpc, grpc, grpc, other, grpc, other, grpc):
        assert dec.decode(enc.encode(headers), raw=True) == headers
    assert tuple(grpc) in enc.blocks
    enc.resize(0)  # the peer's SETTINGS: the next block must carry the size update
    block = enc.encode(grpc)
    assert dec.decode(block, raw=True) == grpc and dec.header_table.maxsize == 0
    assert dec.decode(enc.encode(grpc), raw=True) == grpc


def stopped_short(client_window: int, stream_ids: list[int], size: int):
    """A pair whose server sent ``size`` bytes on each of ``stream_ids`` and stopped short
    wherever a window ran out."""
    client, server = pair(client_window)
    pump(client, server)
    for sid in stream_ids:
        client.send_headers(sid, REQUEST)
    pump(client, server)
    for sid in stream_ids:
        server.send_headers(sid, [(b":status", b"200")])
        server.send_data(sid, b"x" * size)
    pump(client, server)
    return client, server


def test_a_settings_change_is_one_assignment_over_any_number_of_streams():
    """Each SETTINGS_INITIAL_WINDOW_SIZE entry moves every open stream's window: the
    per-stream state does not change, so 2,730 entries in one frame cost no pass over the
    streams (kept one by one, they did: 2 s of CPU for one frame over 16,384 streams)."""
    sids = list(range(1, 400, 2))
    client, server = stopped_short(1000, sids, 10)
    credit = dict(server.send_credit)
    entries = b"".join((0x4).to_bytes(2, "big") + v.to_bytes(4, "big")
                       for v in [70_000, 500] * 1365)
    server.receive(http2._frame(http2.SETTINGS, 0, 0, entries))
    assert server.send_credit == credit
    assert {server.send_window(s) for s in sids} == {490}  # the last value, less the 10 sent


def test_a_grown_initial_window_wakes_the_streams_waiting_for_their_own():
    """A stream that stopped for its own window sends again when the peer's
    SETTINGS_INITIAL_WINDOW_SIZE grows past what it used (no stream WINDOW_UPDATE will
    come: the peer counts the setting as the window). Only the streams it gives window to
    are woken, each once."""
    client, server = stopped_short(100, [1], 150)  # stream 1: 100 sent, 50 to go
    client.send_headers(3, REQUEST)
    pump(client, server)
    server.send_headers(3, [(b":status", b"200")])
    assert server.send_data(3, b"y" * 80) == 80  # stream 3 used 80 and has all it needs
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 100})  # no growth
    s_events, _ = pump(client, server)
    assert not [e for e in s_events if isinstance(e, http2.WindowUpdated)]
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 120})
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [1]
    assert server.send_window(1) == 20
    assert server.send_data(1, b"x" * 50) == 20  # stops again: woken by the next growth
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [1]


def test_a_stream_window_update_wakes_only_a_stream_waiting_for_it():
    client, server = stopped_short(100, [1], 150)
    client.send_headers(3, REQUEST)
    pump(client, server)
    server.send_headers(3, [(b":status", b"200")])
    assert server.send_data(3, b"y" * 50) == 50  # all it had: it waits for nothing
    client.increment_flow_control_window(50, stream_id=1)
    client.increment_flow_control_window(50, stream_id=3)
    client.increment_flow_control_window(50, stream_id=1)  # already woken: no event
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [1]


def test_the_connection_window_wakes_its_waiting_streams_in_order_while_it_lasts():
    """Streams stopped for the connection's window are woken in turn by its WINDOW_UPDATE,
    and no more of them than it lets send: an update of a byte wakes one stream, not every
    waiting one (which cost a walk of all of them an update, the ones waiting for their
    own window included)."""
    client, server = stopped_short(1 << 20, [1], 65535)  # the connection's window spent
    client.send_headers(3, REQUEST)
    client.send_headers(5, REQUEST)
    client.send_headers(7, REQUEST)
    pump(client, server)
    for sid in (3, 5, 7):
        server.send_headers(sid, [(b":status", b"200")])
        assert server.send_data(sid, b"z" * 100) == 0
    client.increment_flow_control_window(150)
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [0]
    woken = []
    while (sid := server.woken()) is not None:
        woken.append(sid)
        server.send_data(sid, b"z" * 100)
    assert woken == [3, 5]  # 100 and 50 bytes: stream 5 waits again, behind stream 7
    client.increment_flow_control_window(1)
    pump(client, server)
    assert server.woken() == 7
    assert server.send_data(7, b"z" * 100) == 1
    assert server.woken() is None  # the byte is spent: stream 5 and 7 wait again
    assert list(server.wanting_connection) == [5, 7]


def test_a_forgotten_stream_is_woken_by_nothing():
    client, server = stopped_short(100, [1, 3], 150)
    client.reset_stream(1)
    pump(client, server)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1000})
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [3]
    assert not server.wanting_own and not server.wanting_connection


def test_a_window_update_of_zero_is_an_error_of_the_window_it_names():
    """RFC 9113 6.9: on a stream, that stream is reset PROTOCOL_ERROR; on the connection,
    the connection ends."""
    client, server = pair()
    pump(client, server)
    client.send_headers(1, REQUEST)
    client.send_headers(3, REQUEST)
    pump(client, server)
    events = server.receive(http2._frame(http2.WINDOW_UPDATE, 0, 1, bytes(4)))
    assert [type(e) for e in events] == [http2.StreamReset] and events[0].stream_id == 1
    assert server.send_window(1) == 0 and server.send_window(3) > 0
    (ended,) = server.receive(http2._frame(http2.WINDOW_UPDATE, 0, 0, bytes(4)))
    assert isinstance(ended, http2.ConnectionTerminated) and ended.code == http2.PROTOCOL_ERROR


def test_settings_enable_push_past_one_ends_the_connection():
    client, server = pair()
    pump(client, server)
    (ended,) = server.receive(http2._frame(http2.SETTINGS, 0, 0, (2).to_bytes(2, "big")
                                           + (2).to_bytes(4, "big")))
    assert isinstance(ended, http2.ConnectionTerminated) and ended.code == http2.PROTOCOL_ERROR


def test_a_stream_update_short_of_a_window_lowers_what_the_setting_must_grow_to():
    """A stream that waits for its own window and gets part of it by its own update (still
    none to send) needs that much less growth of the initial window to send again."""
    client, server = stopped_short(100, [1], 150)  # window 0, 50 bytes to go
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 60})  # -40
    pump(client, server)
    server.send_data(1, b"x" * 50)  # none: waits until the setting passes 100
    client.increment_flow_control_window(30, stream_id=1)  # window -10: still none
    s_events, _ = pump(client, server)
    assert not [e for e in s_events if isinstance(e, http2.WindowUpdated)]
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 80})  # 10, not 100
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [1]
    assert server.send_window(1) == 10


def test_the_wake_heap_stays_bounded_under_partial_stream_updates():
    """Each update short of a window re-keys the stream in the heap, leaving its old entry
    stale: a thousand one-byte updates leave a heap about as large as what waits, not a
    thousand entries (the rebuild that bounds stops also bounds these)."""
    client, server = stopped_short(100, [1], 150)
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})  # -100
    pump(client, server)
    server.send_data(1, b"x" * 50)
    frames = b"".join(http2._frame(http2.WINDOW_UPDATE, 0, 1, (1).to_bytes(4, "big"))
                      for _ in range(99))
    assert not server.receive(frames)  # window -1: still none, no wake
    assert len(server.wake_heap) <= 2 * len(server.wanting_own) + 65
    assert server.wanting_own == {1: 1}
    client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2})
    s_events, _ = pump(client, server)
    assert [e.stream_id for e in s_events if isinstance(e, http2.WindowUpdated)] == [1]

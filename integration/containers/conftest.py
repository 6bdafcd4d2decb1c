"""The end-to-end seed suite against container images: Envoy, Narwhal and simulators
started with testcontainers (host networking, loopback only, Ryuk off).

Images come from NARWHAL_IMAGE / NARWHAL_ENVOY_IMAGE when set (a user's own images);
otherwise they are built here from docker/*.Dockerfile on BASE_IMAGE (default: the
local debootstrap base that docker/debootstrap-base.sh builds, since no registry is
reachable on this project's machines).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

from testcontainers.core.container import DockerContainer  # noqa: E402

from narwhal.launch import REPO_ROOT, StackURLs, free_port, render_envoy, wait_http  # noqa: E402

from ..conftest import MODEL  # noqa: E402

CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def _build(dockerfile: str, tag: str) -> str:
    base = os.environ.get("BASE_IMAGE", "narwhal-base:bookworm")
    shutil.copy(CA_BUNDLE, REPO_ROOT / "docker" / "ca-certificates.crt")
    cmd = ["docker", "build", "--network", "host", "-f", f"docker/{dockerfile}",
           "--build-arg", f"BASE_IMAGE={base}", "-t", tag, "."]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tag


@pytest.fixture(scope="session")
def images() -> tuple[str, str]:
    narwhal = os.environ.get("NARWHAL_IMAGE") or _build("narwhal.Dockerfile", "narwhal:test")
    envoy = os.environ.get("NARWHAL_ENVOY_IMAGE") or _build("envoy.Dockerfile",
                                                           "narwhal-envoy:test")
    return narwhal, envoy


@dataclass
class ContainerSim:
    name: str
    port: int


@dataclass
class ContainerStack(StackURLs):
    """Stands in for narwhal.launch.Stack in the shared seed tests."""

    images: tuple[str, str]
    sim_args: list[str]
    dialect: str = "vllm"
    config: dict = field(default_factory=dict)
    port: int = 0
    admin_port: int = 0
    extproc_port: int = 0
    envoy_admin_port: int = 0
    sims: list[ContainerSim] = field(default_factory=list)
    containers: list[DockerContainer] = field(default_factory=list)

    def _run(self, image: str, command: list[str], volumes: dict[Path, str] | None = None
             ) -> DockerContainer:
        c = DockerContainer(image).with_kwargs(network_mode="host").with_command(command)
        for host, inside in (volumes or {}).items():
            c = c.with_volume_mapping(str(host), inside, "ro")
        c.start()
        self.containers.append(c)
        return c

    def start(self, name: str) -> ContainerStack:
        narwhal, envoy = self.images
        self.port, self.admin_port = free_port(), free_port()
        self.extproc_port, self.envoy_admin_port = free_port(), free_port()
        work = Path(tempfile.mkdtemp(prefix="narwhal-ct-"))
        work.chmod(0o755)
        sim = ContainerSim(name, free_port())
        self.sims.append(sim)
        self._run(narwhal, ["sim", "--host", "127.0.0.1", "--port", str(sim.port),
                            "--model", MODEL, "--dialect", self.dialect, *self.sim_args])
        wait_http(f"http://127.0.0.1:{sim.port}/health", 60)
        cfg = {k: dict(v) for k, v in self.config.items()}
        # The seed suite drives the simulator's faults with x-sim-* headers.
        cfg.setdefault("serving", {}).update(model=MODEL, extproc_port=self.extproc_port,
                                             forward_control_headers=True)
        cfg["telemetry"] = {"admin_port": self.admin_port, "health_interval_ms": 200}
        cfg["engines"] = [{"name": name, "url": f"http://127.0.0.1:{sim.port}",
                           "dialect": self.dialect}]
        (work / "narwhal.yaml").write_text(yaml.safe_dump(cfg))
        self._run(narwhal, ["serve", "--config", "/etc/narwhal/narwhal.yaml"],
                  {work / "narwhal.yaml": "/etc/narwhal/narwhal.yaml"})
        wait_http(f"{self.admin_url}/ready", 60)
        (work / "envoy.yaml").write_text(yaml.safe_dump(
            render_envoy(self.port, self.envoy_admin_port, self.extproc_port,
                         engines=[f"127.0.0.1:{sim.port}"])))
        self._run(envoy, ["-c", "/etc/envoy/custom.yaml", "--disable-hot-restart",
                          "--base-id", str(self.port), "--log-level", "warn"],
                  {work / "envoy.yaml": "/etc/envoy/custom.yaml"})
        wait_http(f"http://127.0.0.1:{self.envoy_admin_port}/ready", 60)
        return self

    def stop(self) -> None:
        for c in reversed(self.containers):
            c.stop()
        self.containers.clear()


def _container_stack(images, name: str, sim_args: list[str], dialect: str = "vllm",
                     config: dict | None = None) -> Iterator[ContainerStack]:
    stack = ContainerStack(images, sim_args, dialect, config or {})
    try:
        yield stack.start(name)
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def stack(images):
    yield from _container_stack(images, "sim-a", [], config={"serving": {
        "max_request_bytes": 65536}})


@pytest.fixture(scope="session")
def reasoning_stack(images):
    yield from _container_stack(images, "sim-r", ["--reasoning", "both"])


@pytest.fixture(scope="session")
def openai_stack(images):
    yield from _container_stack(images, "sim-o", [], dialect="openai")

"""The docs say what the code does: the README's references are read against the code
they describe, so that a default, a key or a fault added or changed without them fails."""

from __future__ import annotations

import dataclasses
import re

import pytest

from narwhal.config import Config, Discovery, EngineConfig
from narwhal.launch import REPO_ROOT
from narwhal.sim.generate import FAULTS

README = (REPO_ROOT / "README.md").read_text()


def _section(title: str, following: str) -> str:
    return README[README.index(title):README.index(following)]


def _table() -> list[tuple[list[str], str, str]]:
    """The README's configuration table, a row each: the names in its key cell, its
    default cell and the whole row."""
    table = _section("## Configuration", "## The simulator")
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 3:
            rows.append((re.findall(r"`([^`]+)`", cells[0]), cells[1], line))
    return rows


def _documented() -> dict[str, str]:
    """Each key the table names and the default written beside it (a row naming several
    keys gives as many defaults, comma-separated)."""
    out = {}
    for keys, default, _ in _table():
        parts = default.split(", ") if len(keys) > 1 else [default]
        for i, key in enumerate(keys):
            out[key] = parts[i] if len(parts) == len(keys) else default
    return out


def _written(value: object) -> str:
    """A default as the README writes it, without the backticks some defaults have."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value or '""'
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {v}" for k, v in value.items()) + "}"
    return str(value)


SECTIONS = ("serving", "admission", "scheduler", "telemetry", "sizing", "router")


def test_the_readme_documents_every_key_with_its_default():
    """A key missing from the reference, or a default that moved without it, is a user
    tuning a setting they cannot find or reading a value the router does not use."""
    rows = _documented()
    whole = {keys[0]: line for keys, _, line in _table()}
    defaults = Config()
    missing, wrong = [], []
    for section in SECTIONS:
        part = getattr(defaults, section)
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            key = f"{section}.{f.name}"
            if dataclasses.is_dataclass(value):  # one row, `key.*`, naming each field
                row = whole.get(f"{key}.*", "")
                missing += [f"{key}.{g.name}" for g in dataclasses.fields(value)
                            if f"`{g.name}`" not in row]
            elif key not in rows:
                missing.append(key)
            elif rows[key].split(" (")[0].strip("`") != _written(value):
                wrong.append(f"{key}: README {rows[key]!r}, code {_written(value)!r}")
    assert not missing, f"keys the README's configuration table does not name: {missing}"
    assert not wrong, wrong


@pytest.mark.parametrize("cls", [EngineConfig, Discovery])
def test_the_readme_names_every_engine_and_discovery_key(cls):
    first = "engines[]" if cls is EngineConfig else "engines: {discovery"
    rows = [line for keys, _, line in _table() if keys[0].startswith(first)]
    named = " ".join(rows)
    assert rows and [f.name for f in dataclasses.fields(cls) if f"`{f.name}`" not in named] == []


def test_the_simulators_faults_are_the_ones_the_readme_lists():
    text = _section("## The simulator", "## Tests")
    listed = re.search(r"x-sim-fault: ([a-z| \n-]+)`", text)
    assert listed is not None
    assert set(listed.group(1).replace("|", " ").split()) == FAULTS


def _metric_names() -> set[str]:
    """Every family the admin port exports, as a scrape names it (a counter with
    ``_total``): from the collectors themselves, with leader election and a worker."""
    from narwhal.config import parse
    from narwhal.core.router import Router
    from narwhal.server.metrics import RouterCollector, WorkersCollector

    router = Router(parse({"engines": [{"name": "a", "url": "http://127.0.0.1:9"}],
                           "router": {"leader_election": {"enabled": True}}}))
    assert router.leadership is not None
    worker = {"index": 0, "up": True, "restarts": 0, "streams": 0, "handoffs": 0,
              "cpu_seconds": 0.0, "rss_bytes": 0, "gc_collected": 0, "gc_uncollectable": 0}
    families = [*RouterCollector(router).collect(), *WorkersCollector(lambda: [worker]).collect()]
    return {m.name + ("_total" if m.type == "counter" else "") for m in families}


def test_the_readme_names_every_metric():
    """The admin section names each series in full, or by its suffix after the
    ``narwhal_engine`` or ``narwhal_worker`` it follows (``_healthy``)."""
    text = _section("## Admin endpoints", "## Active/standby")
    names = _metric_names()
    assert len(names) > 30
    missing = [n for n in sorted(names) if f"`{n}" not in text and not any(
        n.startswith(p) and f"`{n[len(p):]}`" in text
        for p in ("narwhal_engine", "narwhal_worker"))]
    assert missing == []

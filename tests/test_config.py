from __future__ import annotations

import pytest
import yaml

from narwhal.config import Config, ConfigError, load, parse

DESIGN_EXAMPLE = """
serving:   {model: narwhal-sim, max_request_bytes: 1048576}
admission: {mode: predictive, ttft_target_ms: 2000, retention_limit: 1024,
            queue_limit: 256, max_wait_ms: 10000, request_timeout_ms: 600000}
scheduler: {max_prefill_per_engine: 4, max_decode_per_engine: 64}
engines:
  - {name: sim-a, url: "http://127.0.0.1:8001", dialect: vllm}
  - {name: sim-b, url: "http://127.0.0.1:8002", dialect: openai}
router:    {role: active}
telemetry: {admin_port: 9090}
"""


def test_design_example_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(DESIGN_EXAMPLE)
    cfg = load(path)
    assert cfg.serving.max_request_bytes == 1048576
    assert [e.endpoint for e in cfg.engines] == ["127.0.0.1:8001", "127.0.0.1:8002"]
    assert cfg.engines[1].dialect == "openai" and cfg.telemetry.admin_port == 9090


def test_defaults():
    assert parse({}) == Config()
    assert parse(None).admission.mode == "predictive"


@pytest.mark.parametrize(("data", "message"), [
    ({"serving": {"max_request_bytes": "big"}}, "serving.max_request_bytes: expected an integer"),
    ({"serving": {"max_request_bytes": 0}}, "must be positive"),
    ({"serving": {"max_held_bytes": 0}}, "serving.max_held_bytes: must be positive"),
    ({"serving": {"max_held_bytes": 1_000_000}}, "serving.max_held_bytes: what all requests"),
    ({"serving": {"modle": "x"}}, "serving.modle: unknown key"),
    ({"servng": {}}, "servng: unknown section"),
    ({"admission": {"mode": "eager"}}, "admission.mode: must be one of predictive, open"),
    ({"admission": {"queue_order": "lifo"}},
     "admission.queue_order: must be one of fifo, least-work"),
    ({"admission": {"output_token_work": -1}},
     "admission.output_token_work: must not be negative"),
    ({"admission": {"ttft_target_share": 0}}, "admission.ttft_target_share: must be positive"),
    ({"admission": {"ttft_target_share": 1.5}}, "admission.ttft_target_share: the share"),
    ({"scheduler": {"max_prefill_tokens_per_engine": -1}},
     "scheduler.max_prefill_tokens_per_engine: must not be negative"),
    ({"router": {"role": "leader"}}, "router.role"),
    ({"engines": [{"name": "a"}]}, "engines[0].url: required"),
    ({"engines": [{"name": "a", "url": "ftp://x"}]}, "engines[0].url: expected http"),
    # what urllib raises on (a broken IPv6 literal, a port out of range or not a number)
    ({"engines": [{"name": "a", "url": "http://[::1"}]}, "engines[0].url: expected http"),
    ({"engines": [{"name": "a", "url": "http://h:99999"}]}, "engines[0].url: expected http"),
    ({"engines": [{"name": "a", "url": "http://h:port"}]}, "engines[0].url: expected http"),
    ({"engines": [{"name": "a", "url": "http://h:0"}]}, "engines[0].url: expected http"),
    ({"engines": [{"name": "a", "url": "http://h:1", "dialect": "tgi"}]}, "engines[0].dialect"),
    ({"engines": [{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]},
     "duplicate engine name"),
    ({"engines": {"name": "a"}}, "engines.discovery: required"),
    ({"engines": "x"}, "engines: expected a list"),
    ({"engines": {"discovery": "consul", "name": "x"}}, "engines.discovery: must be one of dns"),
    ({"engines": {"discovery": "dns", "name": "x", "port": 0}}, "engines.port: not a port"),
    ({"telemetry": {"admin_port": 70000}}, "not a port"),
    ({"telemetry": {"drift_threshold": 1}}, "telemetry.drift_threshold: a relative error"),
    ({"admission": {"queue_limit": True}}, "expected an integer"),
    ({"admission": {"objectives": ["batch"]}}, "admission.objectives: expected a mapping"),
    ({"admission": {"objectives": {"batch": "low"}}},
     "admission.objectives.batch: expected an integer in [-1000, 1000]"),
    ({"admission": {"objectives": {"batch": -1001}}}, "admission.objectives.batch: expected"),
    ({"admission": {"objectives": {"batch": True}}}, "admission.objectives.batch: expected"),
    ({"serving": {"extproc_socket": "narwhal.sock"}}, "serving.extproc_socket: expected an absolute"),
    ({"serving": {"extproc_socket": "/" + "x" * 120}}, "under 108 bytes"),
    ({"serving": {"extproc_socket": 9002}}, "serving.extproc_socket: expected an absolute"),
    ({"engines": [{"name": "a", "url": "http://h:1", "kv_events": "h:5557"}]},
     "engines[0].kv_events: expected a ZMQ endpoint"),
    ({"engines": [{"name": "a", "url": "http://h:1", "kv_events": "tcp://h:5557",
                   "kv_replay": "h:5558"}]}, "engines[0].kv_replay: expected a ZMQ endpoint"),
    ({"engines": [{"name": "a", "url": "http://h:1", "kv_replay": "tcp://h:5558"}]},
     "engines[0].kv_replay: replays the engine's kv_events; set kv_events too"),
    ({"engines": {"discovery": "dns", "name": "x", "kv_events_port": 70000}},
     "engines.kv_events_port: not a port number"),
    ({"engines": {"discovery": "dns", "name": "x", "kv_replay_port": 5558}},
     "engines.kv_replay_port: replays the engines' KV events; set kv_events_port too"),
    ([1], "top level"),
])
def test_errors_name_the_key(data, message):
    with pytest.raises(ConfigError) as info:
        parse(data)
    assert message in str(info.value)


def test_unreadable_and_invalid_yaml(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("serving: [")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad)


def test_example_file_shipped_is_valid():
    from narwhal.launch import REPO_ROOT

    cfg = load(REPO_ROOT / "examples" / "narwhal.yaml")
    assert yaml.safe_load((REPO_ROOT / "examples" / "narwhal.yaml").read_text())
    assert len(cfg.engines) == 2


def test_dns_discovery_form():
    cfg = parse({"engines": {"discovery": "dns", "name": "vllm.ns.svc", "port": 8000}})
    assert cfg.engines == () and cfg.discovery.name == "vllm.ns.svc"
    assert cfg.discovery.interval_ms == 5000 and cfg.discovery.dialect == "vllm"


def test_ipv6_endpoint_is_bracketed():
    from narwhal.config import EngineConfig

    assert EngineConfig("a", "http://[::1]:8000").endpoint == "[::1]:8000"


def test_admin_token_sources(tmp_path, monkeypatch):
    from narwhal.server.admin import admin_token

    assert admin_token(parse({}).telemetry) is None
    assert admin_token(parse({"telemetry": {"admin_token": "t1"}}).telemetry) == "t1"
    secret = tmp_path / "token"
    secret.write_text("t2\n")
    assert admin_token(parse({"telemetry": {"admin_token_file": str(secret)}}).telemetry) == "t2"
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "t3")
    cfg = parse({"telemetry": {"admin_token_env": "NARWHAL_ADMIN_TOKEN"}})
    assert admin_token(cfg.telemetry) == "t3"
    with pytest.raises(ConfigError, match="admin_token_file"):
        admin_token(parse({"telemetry": {"admin_token_file": str(tmp_path / "nope")}}).telemetry)
    with pytest.raises(ConfigError, match="MISSING_VAR"):
        admin_token(parse({"telemetry": {"admin_token_env": "MISSING_VAR"}}).telemetry)
    with pytest.raises(ConfigError, match="one of"):
        parse({"telemetry": {"admin_token": "a", "admin_token_env": "B"}})


def test_ttft_target_within_its_maximum():
    with pytest.raises(ConfigError, match="max_ttft_target_ms"):
        parse({"admission": {"ttft_target_ms": 70_000}})
    assert parse({"admission": {"ttft_target_ms": 70_000, "max_ttft_target_ms": 70_000}})


def test_objective_priorities_may_be_negative():
    cfg = parse({"admission": {"objectives": {"interactive": 10, "batch-sheddable": -1}}})
    assert cfg.admission.objectives == {"interactive": 10, "batch-sheddable": -1}
    assert parse({}).admission.objectives == {}

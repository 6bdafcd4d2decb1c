"""Every shipped Envoy configuration passes the real `envoy --mode validate`."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path

import pytest
import yaml
from bench.envoy_variants import VARIANTS, ext_proc_filter

from narwhal.launch import ENVOY_CONFIG, REPO_ROOT, envoy_binary, render_envoy

CONFIGS = sorted([ENVOY_CONFIG, *REPO_ROOT.glob("bench/*.yaml")])


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shipped_config_validates(path):
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


def test_rendered_test_config_validates(tmp_path):
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(render_envoy(18080, 19901, 19002)))
    assert validate(path).returncode == 0


def test_validation_catches_a_broken_config(tmp_path):
    cfg = render_envoy(18080, 19901, 19002)
    cfg["static_resources"]["clusters"][1]["load_balancing_policy"]["bogus"] = 1
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert validate(path).returncode != 0


def test_ext_proc_wiring():
    cfg = yaml.safe_load(ENVOY_CONFIG.read_text())
    ext = ext_proc_filter(cfg)
    assert ext["failure_mode_allow"] is False
    mode = ext["processing_mode"]
    assert mode["request_body_mode"] == mode["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert mode["request_trailer_mode"] == mode["response_trailer_mode"] == "SEND"
    engines = cfg["static_resources"]["clusters"][1]
    policy = engines["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.override_host"
    sources = policy["typed_config"]["override_host_sources"]
    assert sources[0] == {"header": "x-gateway-destination-endpoint"}
    served = policy["typed_config"]["selected_host_key"]
    assert served["path"] == [{"key": "x-gateway-destination-endpoint-served"}]
    assert "envoy.lb" in ext["metadata_options"]["forwarding_namespaces"]["untyped"]


@pytest.mark.parametrize("endpoints,dns,kind", [
    (["127.0.0.1:8001", "[::1]:8002"], None, "STATIC"),
    (["vllm-0.vllm:8000"], None, "STRICT_DNS"),
    ([], ("vllm-headless.ns.svc", 8000), "STRICT_DNS")])
def test_engine_pool_renders_and_validates(endpoints, dns, kind, tmp_path):
    cfg = render_envoy(18080, 19901, 19002, engines=endpoints, dns=dns)
    engines = cfg["static_resources"]["clusters"][1]
    assert engines["type"] == kind
    hosts = [(e["endpoint"]["address"]["socket_address"]["address"],
              e["endpoint"]["address"]["socket_address"]["port_value"])
             for e in engines["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert hosts == ([dns] if dns else [("127.0.0.1", 8001), ("::1", 8002)] if kind == "STATIC"
                     else [("vllm-0.vllm", 8000)])
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", [n for n, change in VARIANTS.items() if change is not None])
def test_each_envoy_cost_variant_takes_out_its_extra_and_still_validates(tmp_path, name):
    """``bench.envoy_variants`` measures the shipped config with each extra taken out (and
    with Envoy's other HTTP/2 codec or gRPC client): each edit must apply to the config as
    shipped (a renamed key fails here, not mid-benchmark) and leave a config Envoy accepts."""
    shipped = render_envoy(18080, 19901, 19002)
    cfg = copy.deepcopy(shipped)
    VARIANTS[name](cfg)
    assert cfg != shipped
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = validate(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_refuses_skipping_trailers_with_full_duplex_bodies(tmp_path):
    """Why the trailer messages stay in every request (``bench.envoy_variants``)."""
    cfg = render_envoy(18080, 19901, 19002)
    mode = ext_proc_filter(cfg)["processing_mode"]
    mode["request_trailer_mode"] = "SKIP"
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = validate(path)
    assert result.returncode != 0
    assert "request_trailer_mode has to be set to SEND" in result.stdout + result.stderr

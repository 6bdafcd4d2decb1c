"""The Helm chart: lint, render every optional feature, validate what it renders against
Kubernetes schemas, Narwhal's own config loader and the real `envoy --mode validate`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import kubernetes_validate
import pytest
import yaml

from narwhal.config import parse
from narwhal.launch import ENVOY_CONFIG, REPO_ROOT, envoy_binary

CHART = REPO_ROOT / "charts" / "narwhal"
KUBERNETES = "1.35"
CRD_KINDS = {"ServiceMonitor", "InferencePool", "EnvoyFilter"}
FEATURES = {
    "default": [],
    "gateway": ["--set", "mode=gateway"],
    "discovery": ["--set", "engines.discovery.enabled=true",
                  "--set", "engines.discovery.service=vllm-headless.ns.svc.cluster.local"],
    "kube-discovery": ["--set", "engines.discovery.enabled=true",
                       "--set", "engines.discovery.kind=kubernetes",
                       "--set", "engines.discovery.service=vllm",
                       "--set", "engines.discovery.kvEventsPort=5557",
                       "--set", "engines.discovery.kvReplayPort=5558"],
    "service-monitor": ["--set", "serviceMonitor.enabled=true"],
    "autoscaling": ["--set", "autoscaling.enabled=true"],
    "ha": ["--set", "ha.enabled=true", "--set", "replicaCount=2"],
    "inference-pool": ["--set", "mode=gateway", "--set", "inferencePool.enabled=true"],
    "istio": ["--set", "mode=gateway", "--set", "istio.envoyFilter.enabled=true"],
    "no-pdb": ["--set", "podDisruptionBudget.enabled=false"],
    "expose-extproc": ["--set", "service.exposeExtproc=true"],
    "tcp-extproc": ["--set", "sidecar.unixSocket=false"],
    "workers": ["--set", "sidecar.workers=3"],
    "admin-token": ["--set", "admin.token=s3cret"],
    "admin-secret": ["--set", "admin.existingSecret=ops-narwhal", "--set", "admin.tokenKey=tk",
                     "--set", "mode=gateway"],
    "admin-scrapers": ["--set-json", 'admin.networkPolicy.from=[{"namespaceSelector": '
                       '{"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]'],
    "no-network-policy": ["--set", "admin.networkPolicy.enabled=false"],
    "extproc-peers": ["--set", "mode=gateway", "--set-json",
                      'admin.networkPolicy.extprocFrom=[{"podSelector": '
                      '{"matchLabels": {"app": "gateway"}}}]'],
}


def helm() -> str:
    path = shutil.which("helm") or shutil.which("helm", path=str(REPO_ROOT / ".tools" / "bin"))
    assert path, "helm not found: run `python scripts/fetch_helm.py` (make test does)"
    return path


def render(args: list[str]) -> list[dict]:
    out = subprocess.run([helm(), "template", "narwhal", str(CHART), "--namespace", "llm", *args],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("feature", FEATURES)
def test_lint(feature):
    out = subprocess.run([helm(), "lint", str(CHART), *FEATURES[feature]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("feature", FEATURES)
def test_rendered_manifests_are_valid(feature):
    docs = render(FEATURES[feature])
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] and doc["metadata"]["name"] and doc["spec"]
            continue
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


@pytest.mark.parametrize("feature", FEATURES)
def test_rendered_narwhal_config_loads(feature):
    (cm,) = by_kind(render(FEATURES[feature]), "ConfigMap")
    cfg = parse(yaml.safe_load(cm["data"]["narwhal.yaml"]))
    gateway = "mode=gateway" in FEATURES[feature]
    assert cfg.serving.host == ("0.0.0.0" if gateway else "127.0.0.1")
    assert cfg.telemetry.admin_host == "0.0.0.0"  # kubelet probes the pod IP
    if feature == "discovery":
        assert cfg.discovery.name == "vllm-headless.ns.svc.cluster.local"
        assert not cfg.discovery.kv_events_port and not cfg.kv_events  # none by default
    elif feature == "istio":
        assert cfg.scheduler.fallbacks == 0  # ORIGINAL_DST takes one endpoint
    elif feature == "kube-discovery":
        d = cfg.discovery
        assert (d.discovery, d.name, d.namespace, d.source) == (
            "kubernetes", "vllm", "llm", "endpointslices")
        assert (d.kv_events_port, d.kv_replay_port) == (5557, 5558)
    else:
        assert cfg.engines and cfg.discovery is None


@pytest.mark.parametrize("feature", ["default", "expose-extproc", "ha", "discovery",
                                     "kube-discovery"])
def test_rendered_envoy_config_validates(feature, tmp_path):
    (cm,) = by_kind(render(FEATURES[feature]), "ConfigMap")
    path = tmp_path / "envoy.yaml"
    path.write_text(cm["data"]["envoy.yaml"])
    out = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_chart_envoy_matches_the_repository_envoy():
    (cm,) = by_kind(render([]), "ConfigMap")
    chart = yaml.safe_load(cm["data"]["envoy.yaml"])
    repo = yaml.safe_load(ENVOY_CONFIG.read_text())

    def filters(cfg):
        hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        return hcm["typed_config"]["http_filters"]

    def engines(cfg):
        return next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "engines")

    assert filters(chart) == filters(repo)

    def to_narwhal(cfg):  # its protocol options: the outbound frame limit among them
        cluster = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "narwhal")
        return cluster["typed_extension_protocol_options"]

    assert to_narwhal(chart) == to_narwhal(repo)
    # The Istio gateway's cluster for Narwhal is given the same options (a MERGE patch:
    # rendered and compared here; no Istio runs on this machine).
    (envoy_filter,) = by_kind(render(FEATURES["istio"]), "EnvoyFilter")
    merged = [p["patch"]["value"] for p in envoy_filter["spec"]["configPatches"]
              if p["applyTo"] == "CLUSTER" and p["patch"]["operation"] == "MERGE"]
    assert [m["typed_extension_protocol_options"] for m in merged] == [to_narwhal(repo)]
    # The same cluster but for its members: the chart fills in the configured pool.
    pool_keys = ("type", "load_assignment", "dns_lookup_family")
    assert ({k: v for k, v in engines(chart).items() if k not in pool_keys}
            == {k: v for k, v in engines(repo).items() if k not in pool_keys})
    members = engines(chart)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [m["endpoint"]["address"]["socket_address"] for m in members] == [
        {"address": "vllm-0.vllm", "port_value": 8000}]

    def route(cfg):
        return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]

    assert route(chart) == route(repo)

    def hcm(cfg):
        return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
            "typed_config"]

    for key in ("local_reply_config", "access_log"):
        assert hcm(chart)[key] == hcm(repo)[key]


def test_sidecar_pod_shape():
    docs = render([])
    (dep,) = by_kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["narwhal", "envoy"]
    narwhal = pod["containers"][0]
    assert narwhal["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert narwhal["livenessProbe"]["httpGet"]["path"] == "/live"
    assert all(c["securityContext"]["readOnlyRootFilesystem"] for c in pod["containers"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    (svc,) = by_kind(docs, "Service")
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "admin"}
    assert by_kind(docs, "PodDisruptionBudget")
    # Envoy reaches Narwhal over a Unix socket in the /tmp volume both containers mount.
    (cm,) = by_kind(docs, "ConfigMap")
    sock = yaml.safe_load(cm["data"]["narwhal.yaml"])["serving"]["extproc_socket"]
    envoy = yaml.safe_load(cm["data"]["envoy.yaml"])
    cluster = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "narwhal")
    assert cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"][
        "address"] == {"pipe": {"path": sock}}
    tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    for c in pod["containers"]:
        assert any(m["mountPath"] == "/tmp" and m["name"] in tmp for m in c["volumeMounts"])
        assert sock.startswith("/tmp/")


def test_workers_are_the_envoy_clusters_endpoints():
    (cm,) = by_kind(render(FEATURES["workers"]), "ConfigMap")
    cfg = parse(yaml.safe_load(cm["data"]["narwhal.yaml"]))
    assert cfg.serving.workers == 3
    envoy = yaml.safe_load(cm["data"]["envoy.yaml"])
    cluster = next(c for c in envoy["static_resources"]["clusters"] if c["name"] == "narwhal")
    assert [e["endpoint"]["address"] for e in cluster["load_assignment"]["endpoints"][0][
        "lb_endpoints"]] == [{"pipe": {"path": f"{cfg.serving.extproc_socket}.{i}"}}
                             for i in range(3)]
    out = subprocess.run([helm(), "template", "narwhal", str(CHART), "--set", "sidecar.workers=2",
                          "--set", "sidecar.unixSocket=false"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "sidecar.workers > 1 needs" in out.stderr


def test_gateway_mode_exposes_extproc_and_points_the_pool_at_it():
    docs = render(FEATURES["inference-pool"])
    (dep,) = by_kind(docs, "Deployment")
    assert [c["name"] for c in dep["spec"]["template"]["spec"]["containers"]] == ["narwhal"]
    (svc,) = by_kind(docs, "Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert ports["grpc-extproc"]["port"] == 9002 and "http" not in ports
    (pool,) = by_kind(docs, "InferencePool")
    assert pool["spec"]["endpointPickerRef"] == {
        "name": svc["metadata"]["name"], "port": {"number": 9002}, "failureMode": "FailClose"}


def test_admin_token_comes_from_a_secret_file():
    docs = render(FEATURES["admin-token"])
    (secret,) = by_kind(docs, "Secret")
    (cm,) = by_kind(docs, "ConfigMap")
    cfg = parse(yaml.safe_load(cm["data"]["narwhal.yaml"]))
    assert cfg.telemetry.admin_token_file == "/etc/narwhal-admin/token"
    assert cfg.telemetry.admin_token == ""  # never in the ConfigMap
    (dep,) = by_kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "admin-token"]
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "admin-token", "mountPath": "/etc/narwhal-admin", "readOnly": True} in mounts
    existing = render(FEATURES["admin-secret"])
    assert not by_kind(existing, "Secret")
    (cm,) = by_kind(existing, "ConfigMap")
    assert parse(yaml.safe_load(cm["data"]["narwhal.yaml"])).telemetry.admin_token_file == \
        "/etc/narwhal-admin/tk"


def test_no_token_renders_no_secret():
    docs = render([])
    assert not by_kind(docs, "Secret")
    (cm,) = by_kind(docs, "ConfigMap")
    tel = parse(yaml.safe_load(cm["data"]["narwhal.yaml"])).telemetry
    assert not (tel.admin_token or tel.admin_token_file or tel.admin_token_env)


def test_network_policy_keeps_the_admin_port_closed_by_default():
    (policy,) = by_kind(render([]), "NetworkPolicy")
    ports = [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]]
    assert 9090 not in ports and 8080 in ports
    (policy,) = by_kind(render(FEATURES["admin-scrapers"]), "NetworkPolicy")
    (admin_rule,) = [r for r in policy["spec"]["ingress"] if "from" in r]
    assert admin_rule["ports"] == [{"port": 9090, "protocol": "TCP"}]
    (policy,) = by_kind(render(FEATURES["admin-secret"]), "NetworkPolicy")
    assert [p["port"] for r in policy["spec"]["ingress"] for p in r["ports"]] == [9002]
    assert not by_kind(render(FEATURES["no-network-policy"]), "NetworkPolicy")
    # Gateway mode: the ext_proc port from the gateway's pods alone, when named.
    (policy,) = by_kind(render(FEATURES["extproc-peers"]), "NetworkPolicy")
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9002, "protocol": "TCP"}]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "gateway"}}}]
    (policy,) = by_kind(render(["--set", "service.exposeExtproc=true"]), "NetworkPolicy")
    assert [(r["ports"], "from" in r) for r in policy["spec"]["ingress"]] == [
        ([{"port": 8080, "protocol": "TCP"}], False), ([{"port": 9002, "protocol": "TCP"}], False)]


def test_ha_grants_lease_rbac_and_turns_leader_election_on():
    docs = render(FEATURES["ha"])
    (role,) = by_kind(docs, "Role")
    assert role["rules"][0]["resources"] == ["leases"]
    assert by_kind(docs, "RoleBinding")
    (cm,) = by_kind(docs, "ConfigMap")
    cfg = parse(yaml.safe_load(cm["data"]["narwhal.yaml"]))  # what Narwhal will load
    le = cfg.router.leader_election
    assert le.enabled and le.namespace == "llm" and le.lease_name == "narwhal"
    assert le.renew_deadline_ms < le.lease_duration_ms
    out = subprocess.run([helm(), "template", "narwhal", str(CHART), "--set", "ha.enabled=true",
                          "--set", "replicaCount=1"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "replicaCount >= 2" in out.stderr


@pytest.mark.parametrize(("bad", "where"), [
    (["--set", "mode=mesh"], "/mode"),
    (["--set", "ports.admin=70000"], "/ports/admin"),
    (["--set", "engines.discovery.enabled=true"], "/engines/discovery/service"),
    (["--set", "config.admission.mode=eager"], "/config/admission/mode"),
    (["--set", "config.admission.objectives.batch=-2000"], "/config/admission/objectives/batch"),
    (["--set", "config.admission.fairness=fair"], "/config/admission/fairness"),
    (["--set", "engines.discovery.inferenceObjectives=yes"],
     "/engines/discovery/inferenceObjectives"),
])
def test_schema_rejects_bad_values(bad, where):
    out = subprocess.run([helm(), "template", "narwhal", str(CHART), *bad],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert where in out.stderr


def test_kubernetes_discovery_grants_read_rbac_and_a_token():
    docs = render(FEATURES["kube-discovery"])
    (role,) = by_kind(docs, "Role")
    granted = {r for rule in role["rules"] for r in rule["resources"]}
    assert granted == {"endpointslices", "pods", "inferencepools"}
    assert all(set(rule["verbs"]) == {"get", "list", "watch"} for rule in role["rules"])
    # An InferencePool's objectives: read too, unless turned off.
    pool = [*FEATURES["kube-discovery"], "--set", "engines.discovery.source=inferencepool"]
    for extra, follows in (([], True), (["--set", "engines.discovery.inferenceObjectives=false"],
                                        False)):
        docs = render(pool + extra)
        (role,) = by_kind(docs, "Role")
        rules = {(g, r) for rule in role["rules"] for g in rule["apiGroups"]
                 for r in rule["resources"]}
        assert (("inference.networking.x-k8s.io", "inferenceobjectives") in rules) == follows
        (cm,) = by_kind(docs, "ConfigMap")
        cfg = parse(yaml.safe_load(cm["data"]["narwhal.yaml"]))
        assert cfg.discovery.source == "inferencepool"
        assert cfg.discovery.inference_objectives == follows
    (sa,) = by_kind(docs, "ServiceAccount")
    assert sa["automountServiceAccountToken"] is True
    (default_sa,) = by_kind(render([]), "ServiceAccount")
    assert default_sa["automountServiceAccountToken"] is False


def test_grafana_dashboard_queries_only_metrics_narwhal_exports(stack):
    assert not [d for d in by_kind(render([]), "ConfigMap") if "dashboard" in d["metadata"]["name"]]
    docs = render(["--set", "grafana.dashboard.enabled=true"])
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["narwhal.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {m for e in exprs for m in re.findall(r"narwhal_[a-z_]+", e)}
    exported = set(re.findall(r"^(narwhal_[a-z_]+)", httpx.get(f"{stack.admin_url}/metrics",
                                                                timeout=5).text, re.M))
    # narwhal_leader exists only with leader election on (its suite checks it).
    missing = {n for n in names - exported if not n.startswith("narwhal_leader")}
    assert not missing, missing
    assert len(names) >= 15

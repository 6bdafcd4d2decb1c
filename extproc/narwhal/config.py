"""Configuration: one YAML file, every key defaulted, every mistake named precisely.

Unknown keys are errors, not warnings: a misspelt limit silently left at its default
is exactly the kind of surprise an admission controller must not have.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml


class ConfigError(ValueError):
    """A configuration mistake, with the dotted path of the offending key."""


@dataclass(frozen=True, slots=True)
class Serving:
    model: str = "narwhal-sim"
    max_request_bytes: int = 1_048_576
    host: str = "127.0.0.1"
    extproc_port: int = 9002
    # A Unix socket to serve ext_proc on as well (an Envoy in the same pod: sidecar mode);
    # "" for none. The TCP port stays for probes and peers elsewhere.
    extproc_socket: str = ""
    transport: str = "asyncio"
    max_event_bytes: int = 1_048_576
    max_response_bytes: int = 16_777_216
    # What one process's requests may hold at once: request bodies until they are sent
    # upstream (or refused), assembled non-streaming responses until they are written.
    # Past it a new body is refused 429 and an assembly failed 503, rather than the
    # process outgrowing its memory limit (the chart's: 1 GiB) and losing every request.
    max_held_bytes: int = 268_435_456
    # Forward x-sim-* headers (the simulator's fault injection) to engines: tests and demos.
    forward_control_headers: bool = False
    # A request body not whole this long after its headers is refused 408 (a slow upload
    # would otherwise hold a retention slot until the request's deadline, 600 s).
    request_body_timeout_ms: int = 60_000
    # The ext_proc port's bounds against any peer that reaches it.
    # An engine silent this long while responding fails the request and frees its slot.
    engine_stall_timeout_ms: int = 30_000
    max_connections: int = 1024
    # Open gRPC streams across those connections (each an HTTP request in Envoy; the
    # retention limit refuses completion requests long before): past it, RESOURCE_EXHAUSTED.
    max_streams: int = 16384
    max_message_bytes: int = 4_194_304
    preface_timeout_ms: int = 10_000
    # ext_proc worker processes around this one (server/workers.py); 1: this process
    # alone. Worker i serves on the Unix socket <extproc_socket>.<i>.
    workers: int = 1


@dataclass(frozen=True, slots=True)
class Admission:
    mode: str = "predictive"
    ttft_target_ms: int = 2000
    retention_limit: int = 1024
    queue_limit: int = 256
    # Which queued request takes a freed slot first (core/scheduler.py ``_in_order``):
    # "fifo" (arrival), or "least-work" (the least expected engine work: uncached prompt
    # tokens plus output_token_work x predicted output tokens).
    queue_order: str = "fifo"
    output_token_work: float = 4.0
    max_wait_ms: int = 10_000
    request_timeout_ms: int = 600_000
    # The largest TTFT budget a client may ask for with x-slo-ttft-ms (larger ones clamp).
    max_ttft_target_ms: int = 60_000
    # Time per output token budget for requests without x-slo-tpot-ms; 0: none.
    tpot_target_ms: int = 0
    # The share of each request's TTFT budget (ttft_target_ms or its x-slo-ttft-ms) that
    # admission and placement hold it to: below 1 the queue stays shorter and the tail
    # with it, at some goodput (README, "A target below the SLO"). In (0, 1].
    ttft_target_share: float = 1.0
    # Priorities by InferenceObjective name (the Inference Extension's): a request naming
    # one here (x-gateway-inference-objective, or llm-d's x-llm-d-inference-objective)
    # has its priority, any other 0. Queued requests of a higher priority take freed slots
    # first; a negative priority is sheddable: refused rather than queued (README,
    # "Priorities"). Integers in [-1000, 1000].
    objectives: dict[str, int] = field(default_factory=dict)
    # How the flows of one priority share the queue (a flow: the requests naming one
    # x-gateway-inference-fairness-id, or llm-d's x-llm-d-inference-fairness-id; none
    # named is one flow). none: one queue order across flows (queue_order's);
    # round-robin: the flows take freed slots in turn (README, "Fairness").
    fairness: str = "none"


@dataclass(frozen=True, slots=True)
class Scheduler:
    max_prefill_per_engine: int = 4
    max_decode_per_engine: int = 64
    # Uncached prompt tokens an engine may hold in prefill at once (0: no bound): a
    # request goes there while its own and those ahead stay within this, or while the
    # engine prefills nothing. Prefill slots counted in tokens, so that an engine's own
    # queue is as many steps deep whatever the prompts' sizes.
    max_prefill_tokens_per_engine: int = 0
    # The placement pipeline (core/placement.py): filters in order, weighted scorers, a picker.
    filters: tuple[str, ...] = ("subset", "has-slot", "tpot-budget", "kv-headroom",
                                "verified-backlog")
    scorers: dict[str, float] = field(default_factory=lambda: {"ttft": 1.0})
    picker: str = "max-score"
    # Prompt blocks (64 bytes) remembered per engine for the approximate prefix-cache
    # index (core/prefix.py); 0: off (the engine's own hit rate discounts every prompt).
    prefix_index_blocks: int = 65_536
    # An engine whose scraped KV-cache usage is at least this is saturated: new requests
    # would wait inside it for blocks, which no projection sees (kv-headroom filter).
    kv_usage_limit: float = 0.95
    # Ranked fallback engines sent after the chosen one (x-gateway-destination-endpoint
    # "ip:port,ip:port"): Envoy retries a connect failure or a reset before response
    # headers on the next; 0: the chosen engine only.
    fallbacks: int = 2


@dataclass(frozen=True, slots=True)
class EngineConfig:
    name: str
    url: str
    dialect: str = "vllm"
    # Performance-model seeds, corrected online from measured TTFT and token timing.
    prefill_tps: float = 10000.0
    tpot_ms: float = 20.0
    overhead_ms: float = 5.0
    # The engine's KV-cache event publisher (vLLM --kv-events-config endpoint, e.g.
    # tcp://10.0.0.5:5557): its prefix cache is then known, not guessed. "" for none.
    kv_events: str = ""
    # Its replay socket (vLLM's kv-events-config replay_endpoint): batches missed (before
    # Narwhal subscribed, or lost on the way) are asked for again. "" for none.
    kv_replay: str = ""

    @property
    def endpoint(self) -> str:
        """The ``ip:port`` Envoy's engines cluster knows the engine by (``[v6]:port``)."""
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        return f"[{host}]:{parts.port or 80}" if ":" in host else f"{host}:{parts.port or 80}"


@dataclass(frozen=True, slots=True)
class Discovery:
    """Where the pool comes from. ``dns``: resolve ``name`` (a headless Service) every
    ``interval_ms``. ``kubernetes``: watch the API server: the EndpointSlices of Service
    ``name`` (``source: endpointslices``), or the Pods an InferencePool ``name`` selects,
    one engine per target port (``source: inferencepool``), and then the pool's
    InferenceObjectives as request priorities (``inference_objectives``)."""

    discovery: str
    name: str
    port: int = 8000  # dns; kubernetes: when a slice names no port
    dialect: str = "vllm"
    interval_ms: int = 5000  # dns: re-resolve; kubernetes: retry after a failed watch
    prefill_tps: float = 10000.0
    tpot_ms: float = 20.0
    overhead_ms: float = 5.0
    namespace: str = "default"
    source: str = "endpointslices"
    port_name: str = ""  # endpointslices: the Service port to use (default: the first)
    api_server: str = ""  # empty: in-cluster service account, else $KUBECONFIG
    # Each engine's KV-event publisher and replay socket, on its own address (vLLM's
    # kv-events-config endpoint and replay_endpoint ports). 0 for none.
    kv_events_port: int = 0
    kv_replay_port: int = 0
    # source: inferencepool: follow the InferenceObjectives whose poolRef names the pool,
    # as request priorities over admission.objectives (server/kube_objectives.py).
    inference_objectives: bool = True

    def engine(self, name: str, ip: str, port: int, rank: int = 0) -> EngineConfig:
        """The engine a discovered address is: the pool's seeds, and its KV-event
        sockets on the same address. The ``rank``-th of several engines on one address
        (a Pod's target ports) has them ``rank`` ports up, as vLLM offsets them for each
        data-parallel rank."""
        host = f"[{ip}]" if ":" in ip else ip
        events, replay = (f"tcp://{host}:{p + rank}" if p and p + rank < 65536 else ""
                          for p in (self.kv_events_port, self.kv_replay_port))
        return EngineConfig(name=name, url=f"http://{host}:{port}", dialect=self.dialect,
                            prefill_tps=self.prefill_tps, tpot_ms=self.tpot_ms,
                            overhead_ms=self.overhead_ms, kv_events=events, kv_replay=replay)


@dataclass(frozen=True, slots=True)
class LeaderElection:
    """Active/standby through a coordination.k8s.io/v1 Lease (core/leadership.py): only
    the holder admits; one that cannot renew within renew_deadline_ms is fenced."""

    enabled: bool = False
    lease_name: str = "narwhal"
    namespace: str = "default"
    lease_duration_ms: int = 15_000
    renew_deadline_ms: int = 10_000
    retry_period_ms: int = 2_000
    # Unique per process (default: host name + a random suffix, as client-go does).
    identity: str = ""
    # The API server's URL; empty: in-cluster service account, else $KUBECONFIG.
    api_server: str = ""


@dataclass(frozen=True, slots=True)
class Router:
    role: str = "active"
    # The Inference Extension conformance suite's test-picker hooks (off in production).
    conformance_hooks: bool = False
    leader_election: LeaderElection = field(default_factory=LeaderElection)


@dataclass(frozen=True, slots=True)
class Tracing:
    """OpenTelemetry spans per completion request, sent over OTLP/gRPC (off by default)."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4317"  # an OTLP/gRPC collector
    service_name: str = "narwhal"
    # Share of new traces kept; a request whose caller sampled its trace is always kept.
    sample_ratio: float = 1.0


@dataclass(frozen=True, slots=True)
class Telemetry:
    admin_host: str = "127.0.0.1"
    admin_port: int = 9090
    health_interval_ms: int = 1000
    health_timeout_ms: int = 1000
    # Consecutive timed-out checks before a healthy engine counts as unhealthy: a busy
    # engine answers slowly, which is not a "no". A refused connection or a non-200
    # /health answer marks it unhealthy at once; stale telemetry still applies.
    unhealthy_after_timeouts: int = 3
    stale_after_ms: int = 5000
    # Measure an engine with five synthetic requests before it takes traffic (when it
    # joins, comes back, or its model drifts); off: engines are eligible on health alone.
    profiling: bool = True
    profile_timeout_ms: int = 60_000
    # Mean signed relative TTFT error past which an engine's model is found drifted: it is
    # re-learned and (when another engine can serve) profiled again. 0: never. The limit
    # is a ratio: 0.4 is an engine 1/(1-0.4) = 1.67x slower than modeled, and, the other
    # way, 1.67x faster (an error of -0.4/(1-0.4) = -0.67). Below 1.
    drift_threshold: float = 0.4
    # An engine with KV events that has not published for this long after a dispatch is
    # matched by the approximate prefix index again until its events resume.
    kv_events_stale_ms: int = 5000
    # The bearer token admin mutations (/admin/*) require; with none set they are refused.
    # One of: the token itself, a file holding it (a mounted Secret), an environment variable.
    admin_token: str = ""
    admin_token_file: str = ""
    admin_token_env: str = ""
    # How long a request that ended mid-response waits for Envoy's access log to say
    # whether the engine failed (failed) or the client left (cancelled); 0: no wait.
    close_verdict_ms: int = 1000
    tracing: Tracing = field(default_factory=Tracing)


@dataclass(frozen=True, slots=True)
class Sizing:
    bytes_per_token: float = 4.0
    tokenizer: str = ""  # a tokenizer.json (Hugging Face `tokenizers`); empty: learn bytes/token


@dataclass(frozen=True, slots=True)
class Config:
    serving: Serving = field(default_factory=Serving)
    admission: Admission = field(default_factory=Admission)
    scheduler: Scheduler = field(default_factory=Scheduler)
    engines: tuple[EngineConfig, ...] = ()
    discovery: Discovery | None = None
    router: Router = field(default_factory=Router)
    telemetry: Telemetry = field(default_factory=Telemetry)
    sizing: Sizing = field(default_factory=Sizing)

    @property
    def kv_events(self) -> bool:
        """Whether any engine publishes KV-cache events (named, or by discovery's port):
        then prompts need their exact token IDs, and a subscriber runs per engine."""
        return any(e.kv_events for e in self.engines) or (
            self.discovery is not None and bool(self.discovery.kv_events_port))


PRIORITY_BOUND = 1000  # an objective's priority lies in [-bound, bound]

CHOICES = {
    "admission.mode": ("predictive", "open"),
    "admission.queue_order": ("fifo", "least-work"),
    "admission.fairness": ("none", "round-robin"),
    "serving.transport": ("asyncio", "grpcio"),
    "router.role": ("active", "standby"),
    "engines.dialect": ("vllm", "openai"),
    "engines.discovery": ("dns", "kubernetes"),
    "engines.source": ("endpointslices", "inferencepool"),
}
POSITIVE = {
    "serving.max_request_bytes", "serving.max_event_bytes", "serving.max_response_bytes",
    "serving.max_held_bytes",
    "serving.max_connections", "serving.max_streams", "serving.max_message_bytes",
    "serving.preface_timeout_ms",
    "serving.engine_stall_timeout_ms", "serving.request_body_timeout_ms", "serving.workers",
    "admission.ttft_target_ms", "admission.retention_limit", "admission.max_wait_ms",
    "admission.request_timeout_ms", "admission.max_ttft_target_ms",
    "admission.ttft_target_share",
    "scheduler.max_prefill_per_engine",
    "scheduler.max_decode_per_engine", "telemetry.health_interval_ms",
    "telemetry.health_timeout_ms", "telemetry.stale_after_ms", "telemetry.kv_events_stale_ms",
    "telemetry.unhealthy_after_timeouts", "telemetry.profile_timeout_ms", "engines.prefill_tps",
    "router.leader_election.lease_duration_ms", "router.leader_election.renew_deadline_ms",
    "router.leader_election.retry_period_ms",
    "engines.tpot_ms", "sizing.bytes_per_token", "engines.interval_ms",
}
_ZMQ_ENDPOINT = (lambda v: v.startswith(("tcp://", "ipc://")) and len(v) < 512,
                 "a ZMQ endpoint (tcp://host:port or ipc://path)")
# String settings where "" means none: what a set value must satisfy, and what it is.
OPTIONAL_STRINGS: dict[str, tuple[Callable[[str], bool], str]] = {
    "engines.kv_events": _ZMQ_ENDPOINT,
    "engines.kv_replay": _ZMQ_ENDPOINT,
    "serving.extproc_socket": (lambda v: v.startswith("/") and len(v.encode()) < 108,
                               "an absolute path under 108 bytes (a Unix socket's limit)"),
    "sizing.tokenizer": (lambda v: Path(v).is_file(), "an existing tokenizer file"),
}
MAX_WORKERS = 64
PORTS = {"serving.extproc_port", "telemetry.admin_port", "engines.port"}
OPTIONAL_PORTS = {"engines.kv_events_port", "engines.kv_replay_port"}  # 0: none


def _build(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{path}.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{path}.{f.name}"
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{key}: required")
            continue
        values[f.name] = _check(hints[f.name], data[f.name], key)
    return cls(**values)


def _check(hint: Any, value: Any, key: str) -> Any:
    generic_key = key.split("[")[0] + key[key.rfind("]") + 1:] if "[" in key else key
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if generic_key in POSITIVE and value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
        if (generic_key in PORTS and not 0 < value < 65536) or (
                generic_key in OPTIONAL_PORTS and value > 65535):
            raise ConfigError(f"{key}: not a port number: {value}")
        if value < 0:
            raise ConfigError(f"{key}: must not be negative, got {value}")
        return value
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        if generic_key in POSITIVE and value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
        if value < 0:
            raise ConfigError(f"{key}: must not be negative, got {value}")
        return float(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is str:
        optional = OPTIONAL_STRINGS.get(generic_key)
        if optional is not None:  # "" means none; anything else must be well formed
            valid, expected = optional
            if not isinstance(value, str) or (value and not valid(value)):
                raise ConfigError(f"{key}: expected {expected}, got {value!r}")
            return value
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{key}: expected a non-empty string, got {value!r}")
        allowed = CHOICES.get(generic_key)
        if allowed and value not in allowed:
            raise ConfigError(f"{key}: must be one of {', '.join(allowed)}, got {value!r}")
        return value
    if hint == tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{key}: expected a list of names, got {value!r}")
        return tuple(value)
    if hint == dict[str, int]:  # objective priorities: negative ones are meant
        if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
            raise ConfigError(f"{key}: expected a mapping of name to priority, got {value!r}")
        for k, v in value.items():
            if (not isinstance(v, int) or isinstance(v, bool)
                    or not -PRIORITY_BOUND <= v <= PRIORITY_BOUND):
                raise ConfigError(f"{key}.{k}: expected an integer in [-{PRIORITY_BOUND}, "
                                  f"{PRIORITY_BOUND}], got {v!r}")
        return dict(value)
    if hint == dict[str, float]:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of name to weight, got {value!r}")
        return {str(k): _check(float, v, f"{key}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key)
    raise TypeError(f"unsupported config type {hint!r}")  # pragma: no cover


def _engines(data: Any) -> tuple[EngineConfig, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise ConfigError("engines: expected a list of engines, or {discovery: dns, name: ...}")
    engines = []
    for i, item in enumerate(data):
        eng = _build(EngineConfig, item, f"engines[{i}]")
        try:  # urlsplit raises on a broken IPv6 literal, .port on a bad port
            parts = urlsplit(eng.url)
            valid = parts.scheme == "http" and bool(parts.hostname) and parts.port != 0
        except ValueError:
            valid = False
        if not valid:
            raise ConfigError(f"engines[{i}].url: expected http://host:port, got {eng.url!r}")
        if eng.dialect not in CHOICES["engines.dialect"]:
            raise ConfigError(f"engines[{i}].dialect: must be one of vllm, openai, got {eng.dialect!r}")
        if eng.kv_replay and not eng.kv_events:
            raise ConfigError(f"engines[{i}].kv_replay: replays the engine's kv_events; "
                              "set kv_events too")
        engines.append(eng)
    names = [e.name for e in engines]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"engines: duplicate engine name {name!r}")
    return tuple(engines)


def _discovery(data: dict[str, Any]) -> Discovery:
    d = _build(Discovery, data, "engines")
    if d.kv_replay_port and not d.kv_events_port:
        raise ConfigError("engines.kv_replay_port: replays the engines' KV events; set "
                          "kv_events_port too")
    if "inference_objectives" in data and (d.discovery, d.source) != ("kubernetes",
                                                                      "inferencepool"):
        raise ConfigError("engines.inference_objectives: follows the InferenceObjectives of "
                          "an InferencePool; needs discovery: kubernetes, source: inferencepool")
    return d


def parse(data: Any) -> Config:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("config: expected a mapping at the top level")
    sections = {f.name for f in dataclasses.fields(Config)} - {"discovery"}
    unknown = sorted(set(data) - sections)
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section (known: {', '.join(sorted(sections))})")
    engines = data.get("engines")
    if isinstance(engines, dict):
        kwargs: dict[str, Any] = {"discovery": _discovery(engines)}
    else:
        kwargs = {"engines": _engines(engines)}
    hints = typing.get_type_hints(Config)
    for name in sections - {"engines"}:
        kwargs[name] = _build(hints[name], data.get(name), name)
    tel = kwargs["telemetry"]
    if sum(bool(x) for x in (tel.admin_token, tel.admin_token_file, tel.admin_token_env)) > 1:
        raise ConfigError("telemetry: give one of admin_token, admin_token_file, admin_token_env")
    adm = kwargs["admission"]
    if adm.ttft_target_ms > adm.max_ttft_target_ms:
        raise ConfigError(f"admission.ttft_target_ms: {adm.ttft_target_ms} exceeds "
                          f"admission.max_ttft_target_ms ({adm.max_ttft_target_ms})")
    if adm.ttft_target_share > 1:
        raise ConfigError("admission.ttft_target_share: the share of each request's TTFT "
                          f"budget admission targets, in (0, 1]; got {adm.ttft_target_share}")
    if tel.drift_threshold >= 1:
        raise ConfigError("telemetry.drift_threshold: a relative error (measured - "
                          "predicted) / measured stays below 1; must be below 1 (0: never), "
                          f"got {tel.drift_threshold}")
    if kwargs["telemetry"].tracing.sample_ratio > 1:
        raise ConfigError("telemetry.tracing.sample_ratio: must be between 0 and 1, got "
                          f"{kwargs['telemetry'].tracing.sample_ratio}")
    le = kwargs["router"].leader_election
    if not le.retry_period_ms < le.renew_deadline_ms < le.lease_duration_ms:
        raise ConfigError("router.leader_election: needs retry_period_ms < renew_deadline_ms "
                          f"< lease_duration_ms, got {le.retry_period_ms}, "
                          f"{le.renew_deadline_ms}, {le.lease_duration_ms}")
    if le.enabled and kwargs["router"].role != "active":
        raise ConfigError("router.role: the lease decides the role when "
                          "router.leader_election.enabled; leave role unset")
    serving = kwargs["serving"]
    if serving.max_held_bytes < max(serving.max_request_bytes, serving.max_response_bytes):
        raise ConfigError("serving.max_held_bytes: what all requests may hold at once must "
                          "fit one request's body and one response (serving.max_request_bytes,"
                          f" serving.max_response_bytes); got {serving.max_held_bytes}")
    if serving.workers > 1:
        if serving.workers > MAX_WORKERS:
            raise ConfigError(f"serving.workers: at most {MAX_WORKERS}, got {serving.workers}")
        if serving.transport != "asyncio":
            raise ConfigError("serving.workers: worker processes need serving.transport: "
                              "asyncio")
        if not serving.extproc_socket:
            raise ConfigError("serving.workers: worker processes serve on Unix sockets "
                              "named after serving.extproc_socket; set it")
        if len(f"{serving.extproc_socket}.{serving.workers - 1}".encode()) >= 108:
            raise ConfigError("serving.extproc_socket: too long for the workers' sockets "
                              "(<path>.<i> must stay under 108 bytes)")
    sched = kwargs["scheduler"]
    from .core.placement import check_profile  # the registry lives with the plugins

    try:
        check_profile(sched.filters, sched.scorers, sched.picker)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return Config(**kwargs)


def load(path: str | Path) -> Config:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return parse(data)



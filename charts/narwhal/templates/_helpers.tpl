{{- define "narwhal.name" -}}{{ .Chart.Name }}{{- end -}}
{{- define "narwhal.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}
{{- define "narwhal.labels" -}}
app.kubernetes.io/name: {{ include "narwhal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}
{{- define "narwhal.selectorLabels" -}}
app.kubernetes.io/name: {{ include "narwhal.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
{{- define "narwhal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "narwhal.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}
{{/* Narwhal's config file, from values. */}}
{{- define "narwhal.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $serving := merge (dict "host" (ternary "127.0.0.1" "0.0.0.0" (eq .Values.mode "sidecar")) "extproc_port" (int .Values.ports.extproc)) ($c.serving | default dict) -}}
{{- if include "narwhal.extprocSocket" . -}}
{{- $_ := set $serving "extproc_socket" (include "narwhal.extprocSocket" .) -}}
{{- end -}}
{{- if gt (int .Values.sidecar.workers) 1 -}}
{{- if not (include "narwhal.extprocSocket" .) -}}{{- fail "sidecar.workers > 1 needs mode=sidecar and sidecar.unixSocket=true (workers serve on Unix sockets)" -}}{{- end -}}
{{- $_ := set $serving "workers" (int .Values.sidecar.workers) -}}
{{- end -}}
{{- $telemetry := merge (dict "admin_host" "0.0.0.0" "admin_port" (int .Values.ports.admin)) ($c.telemetry | default dict) -}}
{{- if include "narwhal.adminSecret" . -}}
{{- $_ := set $telemetry "admin_token_file" (printf "/etc/narwhal-admin/%s" .Values.admin.tokenKey) -}}
{{- end -}}
{{- if .Values.ha.enabled -}}
{{- if lt (int .Values.replicaCount) 2 -}}{{- fail "ha.enabled needs replicaCount >= 2 (one leader, at least one standby)" -}}{{- end -}}
{{- $router := deepCopy ($c.router | default dict) -}}
{{- $_ := unset $router "role" -}}
{{- $_ := set $router "leader_election" (dict "enabled" true "lease_name" (default (include "narwhal.fullname" .) .Values.ha.leaseName) "namespace" .Release.Namespace "lease_duration_ms" (int .Values.ha.leaseDurationMs) "renew_deadline_ms" (int .Values.ha.renewDeadlineMs) "retry_period_ms" (int .Values.ha.retryPeriodMs)) -}}
{{- $_ := set $c "router" $router -}}
{{- end -}}
{{- if .Values.istio.envoyFilter.enabled -}}
{{- /* The EnvoyFilter's ORIGINAL_DST cluster takes one endpoint, not a fallback list. */ -}}
{{- $_ := set $c "scheduler" (merge (dict "fallbacks" 0) ($c.scheduler | default dict)) -}}
{{- end -}}
{{- $_ := set $c "serving" $serving -}}
{{- $_ := set $c "telemetry" $telemetry -}}
{{- if and .Values.engines.discovery.enabled (eq .Values.engines.discovery.kind "kubernetes") -}}
{{- $kube := dict "discovery" "kubernetes" "name" .Values.engines.discovery.service "namespace" .Release.Namespace "source" .Values.engines.discovery.source "port" (int .Values.engines.discovery.port) "dialect" .Values.engines.discovery.dialect "interval_ms" (int .Values.engines.discovery.intervalMs) "kv_events_port" (int .Values.engines.discovery.kvEventsPort) "kv_replay_port" (int .Values.engines.discovery.kvReplayPort) -}}
{{- if eq .Values.engines.discovery.source "inferencepool" -}}
{{- $_ := set $kube "inference_objectives" .Values.engines.discovery.inferenceObjectives -}}
{{- end -}}
{{- $_ := set $c "engines" $kube -}}
{{- else if .Values.engines.discovery.enabled -}}
{{- $_ := set $c "engines" (dict "discovery" "dns" "name" .Values.engines.discovery.service "port" (int .Values.engines.discovery.port) "dialect" .Values.engines.discovery.dialect "interval_ms" (int .Values.engines.discovery.intervalMs) "kv_events_port" (int .Values.engines.discovery.kvEventsPort) "kv_replay_port" (int .Values.engines.discovery.kvReplayPort)) -}}
{{- else -}}
{{- $_ := set $c "engines" .Values.engines.static -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}
{{/* Whether the pod talks to the Kubernetes API (leader election, kubernetes discovery). */}}
{{- define "narwhal.usesKubeAPI" -}}
{{- if or .Values.ha.enabled (and .Values.engines.discovery.enabled (eq .Values.engines.discovery.kind "kubernetes")) -}}true{{- end -}}
{{- end -}}
{{/* The Secret holding the admin token, if any. */}}
{{- define "narwhal.adminSecret" -}}
{{- if .Values.admin.existingSecret -}}{{ .Values.admin.existingSecret }}
{{- else if .Values.admin.token -}}{{ include "narwhal.fullname" . }}-admin
{{- end -}}
{{- end -}}
{{/* Sidecar mode: Envoy reaches Narwhal over a Unix socket in the pod's shared /tmp
(bench.datapath: ~10% less CPU per request on both sides than loopback TCP). */}}
{{- define "narwhal.extprocSocket" -}}
{{- if and (eq .Values.mode "sidecar") .Values.sidecar.unixSocket -}}/tmp/narwhal-extproc.sock{{- end -}}
{{- end -}}

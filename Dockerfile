# kvbroker sidecar image.
#   docker build -t kvbroker:cpu .                          host memory: NIXL + Mooncake (non-CUDA), no torch
#   docker build --build-arg FLAVOR=cuda -t kvbroker:cuda .  GPU pods: NIXL + Mooncake CUDA builds
#   bash scripts/image.sh                                   the CPU image with podman, from a base made here
# The same file for Docker, BuildKit and buildah: no construct one of them lacks (an ARG in a stage name).
# Runs `kvbroker serve` as UID 10001: local API on unix:/run/kvbroker/kvbroker.sock, peer API on
# 0.0.0.0:50052, JSON logs. Every setting is a KVBROKER_* variable (README, Operations).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG FLAVOR=cpu

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# What the engine wheels link but do not bundle: Mooncake needs libibverbs, libnuma and libcurl even
# over tcp; ibverbs-providers holds the NIC drivers (mlx5, efa, ...) RDMA needs. Versions follow the
# base image's Debian release, which takes security updates, so they are not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libibverbs1 ibverbs-providers libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 kvbroker \
    && useradd --system --uid 10001 --gid kvbroker --home-dir /nonexistent --no-create-home \
       --shell /usr/sbin/nologin kvbroker

FROM base AS build
ARG FLAVOR
# gcc compiles kvbroker's one C extension, the SIGBUS guard (kvbroker/memory/_memguard.c), with Python's
# headers: the official image has them, Debian's python3 (scripts/image.sh's base) takes python3-dev. All
# of it stays in this stage. Versions follow the base image's Debian release.
# hadolint ignore=DL3008
RUN headers="$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" \
    && dev="" && { [ -e "$headers" ] || dev=python3-dev; } \
    && apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ${dev:+"$dev"} \
    && rm -rf /var/lib/apt/lists/*
# The daemon's dependencies exactly as locked (hash-checked, nothing resolved), then the daemon and its
# client package without theirs. CPU flavor: locks/image-cpu.txt, the runtime's pins without torch
# (NIXL's build wheels name it, the daemon imports NIXL without it: locks/image-cpu.in), all from PyPI.
# CA_BUNDLE: the certificates pip trusts, where a proxy between the build and the index re-signs TLS
# (scripts/image.sh mounts the host's bundle for the build only); unset, pip's own.
ARG CA_BUNDLE=""
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY locks/image-cpu.txt locks/runtime-cuda.txt locks/
RUN case "$FLAVOR" in \
      cpu) pip install --no-cache-dir --require-hashes --no-deps ${CA_BUNDLE:+--cert "$CA_BUNDLE"} \
             -r locks/image-cpu.txt ;; \
      cuda) pip install --no-cache-dir --require-hashes --no-deps ${CA_BUNDLE:+--cert "$CA_BUNDLE"} \
              -r locks/runtime-cuda.txt ;; \
      *) echo "FLAVOR must be cpu or cuda, not '$FLAVOR'" >&2; exit 1 ;; \
    esac
COPY clients/python clients/python
COPY pyproject.toml setup.py ./
COPY kvbroker kvbroker
# Then what the daemon never runs leaves the venv: NIXL's expert-parallel extension (nixl_ep_cu*, ~90 MB,
# built against torch, which this image does not carry; the cuda flavor's daemon does not use it either),
# and pip and setuptools, which only installed.
RUN pip install --no-cache-dir --no-deps --no-build-isolation ./clients/python . \
    && kvbroker serve --help > /dev/null \
    && rm -rf "$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"/nixl_ep_cu* \
    && pip uninstall --yes --quiet pip setuptools

FROM base AS runtime
# Both flavors: the stages differ only in the venv they copy. The NVIDIA container runtime mounts the
# driver's compute libraries only when asked to; elsewhere nothing reads the variable.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build /opt/venv /opt/venv
RUN install -d -o kvbroker -g kvbroker -m 0770 /run/kvbroker
ENV PATH=/opt/venv/bin:$PATH \
    KVBROKER_LISTEN=unix:/run/kvbroker/kvbroker.sock \
    KVBROKER_HEALTH_LISTEN=unix:/run/kvbroker/health.sock \
    KVBROKER_PEER_LISTEN=0.0.0.0:50052 \
    KVBROKER_LOG_FORMAT=json
USER 10001:10001
EXPOSE 50052 9400
# Checks the health listener (KVBROKER_HEALTH_LISTEN; the local API, KVBROKER_LISTEN, when it is
# set empty) through grpc.health.v1; set addresses through KVBROKER_* variables rather than flags so
# that the check follows them.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-m", "kvbroker.ops.probe", "--timeout", "3"]
ENTRYPOINT ["kvbroker", "serve"]

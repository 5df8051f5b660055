# onnxps: two images from one file.
#   docker build -t onnxps .                   # target "server" (the default): the
#                                              # server, the CLI and the client library
#   docker build --target demo -t onnxps-demo .  # the same plus scikit-learn, whose
#                                              # bundled digits the demo workers train on
#   docker build --target etcd -t onnxps-etcd .   # Debian's etcd-server, for the
#                                              # compose profile "replicated"
# All run as unprivileged users ("onnxps", uid 10001; etcd as "etcd"), never as root.
# BASE: any Debian-like image with python and pip on PATH (tests/containers/test_containers.py
# builds with a local stand-in made by scripts/container_base.sh: no registry there).
ARG BASE=python:3.12-slim
FROM ${BASE} AS base

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin onnxps \
    && mkdir /data && chown onnxps:onnxps /data
WORKDIR /app
# The whole context less .dockerignore (tests, benchmarks, docs, deploy, .git, .venv):
# every package directory pyproject.toml maps is in it, whatever is added later.
COPY . .
# [replication]: etcd's client, for --coordinator and Client("etcd://...").
RUN pip install '.[replication]'


FROM base AS demo
RUN pip install '.[demo]'
USER onnxps
CMD ["python", "-m", "onnxps.cli._demo_worker"]


# etcd for replicated shards (docker-compose.yml, profile "replicated"): Debian's
# etcd-server package on the same Debian-like BASE (any etcd 3.4 or later works;
# Kubernetes uses the upstream image, deploy/kubernetes/components/etcd). Python
# stays in the image: the compose health check asks /health with it.
FROM ${BASE} AS etcd
# policy-rc.d: the package's postinst would start the daemon inside the build.
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d \
    && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends etcd-server \
    && rm -rf /var/lib/apt/lists/* /usr/sbin/policy-rc.d \
    && mkdir -p /var/lib/etcd/data && chown -R etcd:etcd /var/lib/etcd \
    && chmod 700 /var/lib/etcd/data
VOLUME /var/lib/etcd
EXPOSE 2379
USER etcd
CMD ["etcd", "--data-dir", "/var/lib/etcd/data"]


FROM base AS server
# Snapshots (and the WAL with --durability wal) live here; mount a volume on it. (Not
# in the demo image: a worker keeps nothing, and would leave an anonymous volume.)
VOLUME /data
EXPOSE 50051
USER onnxps
# 0.0.0.0 without TLS and tokens is refused unless --insecure: give TLS and a token
# file (--tls-cert, --tls-key, --tokens-file) when the port leaves a private network.
CMD ["onnxps", "serve", "--address", "0.0.0.0:50051", "--insecure", "--data-dir", "/data"]

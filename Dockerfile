# onnxps: the server, the client library and the demo worker in one image.
FROM python:3.12-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY client ./client
COPY server ./server
COPY cli ./cli
COPY examples ./examples
# The demo extra adds scikit-learn, whose bundled digits data set the workers train on.
RUN pip install '.[demo]'

# Snapshots (and the WAL with --durability wal) live here; mount a volume on it.
VOLUME /data
EXPOSE 50051

# 0.0.0.0 without TLS and tokens is refused unless --insecure: give TLS and a token
# file (--tls-cert, --tls-key, --tokens-file) when the port leaves a private network.
CMD ["onnxps", "serve", "--address", "0.0.0.0:50051", "--insecure", "--data-dir", "/data"]

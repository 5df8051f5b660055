#!/usr/bin/env bash
# A replicated shard on this machine, end to end: etcd, three onnxps replicas (a
# primary and two standbys), a worker pushing through them, the primary killed with
# kill -9 half-way, and the worker's T checked exact (docs/cluster.md, "Replicated
# shards on one machine", gives the same commands to type one by one).
#
#   bash scripts/local_replicated.sh     # needs etcd on PATH (Debian: etcd-server)
#                                        # and onnxps[replication] in $PYTHON
#
# Exit status 0 when every push was applied exactly once across the failover (the
# worker's last T and the new primary's T both equal STEPS), 1 otherwise. Every
# process it started is stopped on exit; their logs stay in $WORK.
# Settings (environment): PYTHON (default: .venv/bin/python if present, else
# python3), WORK (default: a new temp directory), ETCD_PORT (2379), ETCD_PEER_PORT
# (2380), PORT (50061: the replicas listen on PORT, PORT+1, PORT+2), STEPS (400).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
WORK=${WORK:-$(mktemp -d -t onnxps-replicated.XXXXXX)}
ETCD_PORT=${ETCD_PORT:-2379}
ETCD_PEER_PORT=${ETCD_PEER_PORT:-2380}
PORT=${PORT:-50061}
STEPS=${STEPS:-400}
COORDINATOR="etcd://127.0.0.1:$ETCD_PORT/local"
ETCD=${ONNXPS_ETCD_BIN:-etcd}
PIDS=()

say() { echo "== $*"; }
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
command -v "$ETCD" >/dev/null || {
  echo "etcd is not installed: apt-get install etcd-server (or ONNXPS_ETCD_BIN)" >&2
  exit 1
}
mkdir -p "$WORK"
say "logs and data in $WORK"

# 1. etcd: one member on loopback, its data in $WORK/etcd.
say "etcd on 127.0.0.1:$ETCD_PORT"
"$ETCD" --name local --data-dir "$WORK/etcd" \
  --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "local=http://127.0.0.1:$ETCD_PEER_PORT" \
  > "$WORK/etcd.log" 2>&1 &
PIDS+=($!)
etcd_up() {
  "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$ETCD_PORT/health', timeout=1)" 2>/dev/null
}
for _ in $(seq 100); do etcd_up && break; sleep 0.2; done
etcd_up || { echo "etcd did not start: see $WORK/etcd.log" >&2; exit 1; }

# 2. Three replicas of shard 0 of 1: the same --coordinator and --shard, each its
# own --member-id, address and data directory; one standby acknowledges each push
# before the primary does (--sync-replicas 1); a primary's lease lasts 3 s.
declare -A REPLICA_PID
for i in 0 1 2; do
  say "replica r$i on 127.0.0.1:$((PORT + i))"
  "$PYTHON" -m onnxps serve --address "127.0.0.1:$((PORT + i))" \
    --data-dir "$WORK/r$i" --durability wal \
    --coordinator "$COORDINATOR" --shard 0/1 --member-id "r$i" \
    --sync-replicas 1 --lease-ttl 3 > "$WORK/r$i.log" 2>&1 &
  PIDS+=($!)
  REPLICA_PID[r$i]=$!
done

# `onnxps status etcd://...` lists the members: MEMBER ROLE ... (the primary's
# role is "primary"); wait for a primary and two standbys.
primary() {
  "$PYTHON" -m onnxps status "$COORDINATOR" --timeout 5 2>/dev/null \
    | awk '$4 == "primary" && $2 ~ /^r[0-9]$/ { print $2 }'
}
standbys() {
  "$PYTHON" -m onnxps status "$COORDINATOR" --timeout 5 2>/dev/null \
    | awk '$4 == "standby" && $2 ~ /^r[0-9]$/' | wc -l
}
for _ in $(seq 120); do
  if [ -n "$(primary)" ] && [ "$(standbys)" = 2 ]; then break; fi
  sleep 0.5
done
FIRST=$(primary)
[ -n "$FIRST" ] || { echo "no primary elected: see $WORK/r*.log" >&2; exit 1; }
say "primary: $FIRST"

# 3. A worker: finds the primary in etcd, pushes STEPS gradients, follows failovers
# (each call resends within its 60 s deadline; a resent push is applied once).
cat > "$WORK/worker.py" <<'EOF'
import sys, time
import numpy as np
from onnxps.client import Adam, Client

coordinator, steps = sys.argv[1], int(sys.argv[2])
with Client(coordinator, timeout=60) as ps:
    ps.create_group("recipe", Adam(), learning_rate=0.01,
                    tensors={"w": np.zeros(1000, np.float32)})
    g = np.full(1000, 0.5, np.float32)
    for step in range(1, steps + 1):
        t = ps.push("recipe", g)
        if step % 50 == 0:
            print(f"step {step}/{steps}: T={t}", flush=True)
        time.sleep(0.02)
    print(f"worker done: T={t}", flush=True)
EOF
say "worker: $STEPS pushes"
"$PYTHON" "$WORK/worker.py" "$COORDINATOR" "$STEPS" > "$WORK/worker.log" 2>&1 &
WORKER=$!
PIDS+=($WORKER)

# 4. kill -9 the primary once a quarter of the pushes are in (the worker prints
# every 50th).
KILL_AT=$(( (STEPS / 4 + 49) / 50 * 50 ))
for _ in $(seq 600); do
  grep -q "^step $KILL_AT/" "$WORK/worker.log" && break
  kill -0 "$WORKER" 2>/dev/null || break
  sleep 0.1
done
say "kill -9 the primary $FIRST (pid ${REPLICA_PID[$FIRST]}) under the worker"
kill -9 "${REPLICA_PID[$FIRST]}"
{ wait "${REPLICA_PID[$FIRST]}"; } 2>/dev/null || true  # no "Killed" job notice
for _ in $(seq 120); do
  NOW=$(primary)
  if [ -n "$NOW" ] && [ "$NOW" != "$FIRST" ]; then break; fi
  sleep 0.5
done
say "new primary: ${NOW:-none}"

# 5. The worker ends; every push counted once: T == STEPS on the new primary.
if ! wait "$WORKER"; then
  echo "the worker failed:" >&2
  cat "$WORK/worker.log" >&2
  exit 1
fi
cat "$WORK/worker.log"
"$PYTHON" -m onnxps status "$COORDINATOR" --timeout 5 | tee "$WORK/status.txt"
T=$(awk '$1 == "recipe" { print $6 }' "$WORK/status.txt")
if grep -qx "worker done: T=$STEPS" "$WORK/worker.log" && [ "$T" = "$STEPS" ]; then
  say "T=$T after the kill -9 of $FIRST: every push applied exactly once"
else
  echo "T is not exact: the worker's $(tail -n 1 "$WORK/worker.log"), status T=$T" >&2
  exit 1
fi

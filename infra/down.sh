#!/usr/bin/env bash
# Stop the local Kafka broker and MinIO server started by infra/up.sh (`make infra-down`).
#
#   infra/down.sh          stop both; keep data (.infra/kafka-data, .infra/minio-data),
#                          credentials (.infra/env) and caches (.infra/cache)
#   infra/down.sh --wipe   also delete the data directories and .infra/env (caches stay)
#
# Each service gets SIGTERM (Kafka shuts down cleanly) and up to STAGETREE_INFRA_STOP_TIMEOUT
# seconds (default 30) before SIGKILL. Only processes whose pid file infra/up.sh wrote, and whose
# command line still matches, are signalled. Idempotent: nothing running -> nothing to do.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=$ROOT/.infra
STOP_TIMEOUT=${STAGETREE_INFRA_STOP_TIMEOUT:-30}
WIPE=0
case "${1:-}" in
    "") ;;
    --wipe) WIPE=1 ;;
    *) echo "usage: infra/down.sh [--wipe]" >&2; exit 2 ;;
esac

say() { echo "infra-down: $*"; }
running() { # PIDFILE MARKER
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1")
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2"
}
alive() { # PID (a zombie counts as gone)
    [ -r "/proc/$1/stat" ] || return 1
    [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1)" != Z ]
}

stop() { # NAME PIDFILE MARKER
    local name=$1 pidfile=$2 marker=$3 pid waited=0
    if ! running "$pidfile" "$marker"; then
        say "$name is not running"
        rm -f "$pidfile"
        return 0
    fi
    pid=$(cat "$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    while alive "$pid" && [ "$waited" -lt $((STOP_TIMEOUT * 10)) ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if alive "$pid"; then
        say "$name (pid $pid) did not stop within ${STOP_TIMEOUT}s of SIGTERM; sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null || true
    else
        say "$name stopped (pid $pid, $((waited / 10)).$((waited % 10))s)"
    fi
    rm -f "$pidfile"
}

mkdir -p "$STATE"
exec 9>"$STATE/infra.lock"
flock -w 3600 9 || { echo "infra-down: error: another infra/up.sh or infra/down.sh holds $STATE/infra.lock" >&2; exit 1; }

# Stop both at once: Kafka's clean shutdown takes a few seconds.
stop kafka "$STATE/kafka.pid" "kafka.Kafka" &
k=$!
stop minio "$STATE/minio.pid" "minio server"
wait "$k"

if [ "$WIPE" = 1 ]; then
    rm -rf "$STATE/kafka-data" "$STATE/minio-data" "$STATE/kafka" "$STATE/env"
    say "wiped .infra/kafka-data, .infra/minio-data and .infra/env (caches kept in .infra/cache)"
fi

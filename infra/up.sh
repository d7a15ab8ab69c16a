#!/usr/bin/env bash
# Start the local services stagetree runs against in Kafka mode (development and CI):
#
#   * Apache Kafka 3.9.2 in KRaft combined mode (broker + controller, node.id=1),
#     PLAINTEXT on 127.0.0.1:9092, controller on 127.0.0.1:9093, data in .infra/kafka-data.
#     Jars from Maven Central (infra/kafka/pom.xml, `mvn dependency:copy-dependencies`),
#     storage formatted with `kafka.tools.StorageTool format`, started with `java -cp ... kafka.Kafka`.
#   * MinIO on 127.0.0.1:9000 (console disabled), data in .infra/minio-data, built from source
#     with `go install github.com/minio/minio@$MINIO_VERSION`; bucket `stagetree` created.
#
# Writes .infra/env (mode 0600, sourceable: `. .infra/env`) with STAGETREE_BOOTSTRAP_SERVERS,
# STAGETREE_CHECKPOINT_STORE, STAGETREE_S3_ENDPOINT, STAGETREE_S3_SECURE and the generated MinIO
# credentials STAGETREE_S3_ACCESS_KEY / STAGETREE_S3_SECRET_KEY (generated once, never printed).
#
# Idempotent: a service that is already running and healthy is left alone. Jars, the Maven
# repository, the Go module/build caches and the MinIO binary are cached under .infra/cache.
# Waits for health (Kafka lists topics, MinIO lists buckets) up to STAGETREE_INFRA_TIMEOUT
# seconds (default 120) and exits 1 naming what failed, with the tail of its log.
#
# Environment: STAGETREE_INFRA_PYTHON (default .venv/bin/python, needs confluent-kafka and minio),
# STAGETREE_INFRA_TIMEOUT, STAGETREE_KAFKA_HEAP (default "-Xms256m -Xmx768m").
# Stop with infra/down.sh (`make infra-down`).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

STATE=$ROOT/.infra
CACHE=$STATE/cache
LOGS=$STATE/logs

KAFKA_VERSION=$(sed -n 's:.*<kafka.version>\(.*\)</kafka.version>.*:\1:p' infra/kafka/pom.xml)
KAFKA_HOST=127.0.0.1
KAFKA_PORT=9092
KAFKA_CONTROLLER_PORT=9093
KAFKA_LIBS=$CACHE/kafka/libs
KAFKA_DATA=$STATE/kafka-data
KAFKA_LOG=$STATE/kafka.log
KAFKA_PID=$STATE/kafka.pid

# MinIO: the module proxy here serves only the newest snapshot of github.com/minio/minio
# (tags such as RELEASE.2025-10-15T17-29-55Z are refused), so the pin is its pseudo-version:
# the last commit of the repository (2026-02-12, maintenance mode), which contains
# RELEASE.2025-10-15T17-29-55Z plus a few S3 API fixes. Builds with Go >= 1.24.
MINIO_MODULE=github.com/minio/minio
MINIO_VERSION=v0.0.0-20260212201848-7aac2a2c5b7c
MINIO_HOST=127.0.0.1
MINIO_PORT=9000
MINIO_CONSOLE_PORT=9001
MINIO_BIN=$CACHE/go/bin/minio
MINIO_DATA=$STATE/minio-data
MINIO_LOG=$STATE/minio.log
MINIO_PID=$STATE/minio.pid
BUCKET=stagetree

ENV_FILE=$STATE/env
TIMEOUT=${STAGETREE_INFRA_TIMEOUT:-120}
PY=${STAGETREE_INFRA_PYTHON:-$ROOT/.venv/bin/python}
KAFKA_HEAP=${STAGETREE_KAFKA_HEAP:--Xms256m -Xmx768m}

say() { echo "infra-up: $*"; }
tail_log() { # FILE
    if [ -s "$1" ]; then
        echo "----- last 30 lines of ${1#"$ROOT"/} -----" >&2
        tail -n 30 "$1" >&2
        echo "-----" >&2
    fi
}
die() { # MESSAGE [LOGFILE]
    echo "infra-up: error: $1" >&2
    [ $# -lt 2 ] || tail_log "$2"
    exit 1
}
# running PIDFILE MARKER: the pid in PIDFILE is alive and its command line contains MARKER.
running() {
    local pid
    [ -s "$1" ] || return 1
    pid=$(cat "$1")
    [ -r "/proc/$pid/cmdline" ] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$2"
}
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
elapsed() { echo "$((SECONDS - START))s"; }

START=$SECONDS
mkdir -p "$STATE" "$CACHE" "$LOGS"

# One infra/up.sh or infra/down.sh at a time (a second waits, e.g. while the first builds MinIO).
# Every process started below gets `9>&-`: a detached service must not hold the lock.
exec 9>"$STATE/infra.lock"
flock -w 3600 9 || die "another infra/up.sh or infra/down.sh holds $STATE/infra.lock"

# ---------------------------------------------------------------- preflight
[ -x "$PY" ] || die "no Python at $PY (run 'make venv' or set STAGETREE_INFRA_PYTHON)"
"$PY" -c 'import confluent_kafka, minio' 2>/dev/null \
    || die "$PY cannot import confluent_kafka and minio (run 'make venv')"

# ---------------------------------------------------------------- .infra/env
# Credentials are generated once and kept; every other line is rewritten on each run. They are
# read from our own file only (never the caller's environment), held in unexported variables and
# handed to MinIO and the health check alone, so no other child process (Kafka, Maven, Go) sees them.
unset STAGETREE_S3_ACCESS_KEY STAGETREE_S3_SECRET_KEY
env_value() { [ -f "$ENV_FILE" ] || return 0; sed -n "s/^export $1='\(.*\)'\$/\1/p" "$ENV_FILE" | tail -n 1; }
ACCESS_KEY=$(env_value STAGETREE_S3_ACCESS_KEY)
SECRET_KEY=$(env_value STAGETREE_S3_SECRET_KEY)
if [ -z "$ACCESS_KEY" ] || [ -z "$SECRET_KEY" ]; then
    if [ -d "$MINIO_DATA/.minio.sys" ]; then
        say "warning: $ENV_FILE had no MinIO credentials; generating new ones for existing $MINIO_DATA" >&2
    fi
    { read -r ACCESS_KEY && read -r SECRET_KEY; } < <("$PY" infra/health.py new-credentials) \
        || die "could not generate MinIO credentials"
fi
(
    umask 077
    cat >"$ENV_FILE.tmp" <<EOF
# Written by infra/up.sh for the local Kafka and MinIO. Secrets: never commit, print or log this file.
export STAGETREE_BOOTSTRAP_SERVERS=$KAFKA_HOST:$KAFKA_PORT
export STAGETREE_CHECKPOINT_STORE=s3://$BUCKET/checkpoints
export STAGETREE_S3_ENDPOINT=$MINIO_HOST:$MINIO_PORT
export STAGETREE_S3_SECURE=false
export STAGETREE_S3_ACCESS_KEY='$ACCESS_KEY'
export STAGETREE_S3_SECRET_KEY='$SECRET_KEY'
EOF
    mv -f "$ENV_FILE.tmp" "$ENV_FILE"
)

# ---------------------------------------------------------------- MinIO build (background)
minio_built() {
    [ -x "$MINIO_BIN" ] || return 1
    [ "$(go version -m "$MINIO_BIN" 2>/dev/null | awk '$1 == "mod" {print $3; exit}')" = "$MINIO_VERSION" ]
}
BUILD_PID=
MINIO_RUNNING=0
running "$MINIO_PID" "minio server" && MINIO_RUNNING=1
if [ "$MINIO_RUNNING" = 0 ] && ! minio_built; then
    command -v go >/dev/null || die "MinIO needs Go to build (go install $MINIO_MODULE@$MINIO_VERSION): no 'go' on PATH"
    say "building MinIO $MINIO_VERSION with $(go version | awk '{print $3}') (first run only; several minutes) ..."
    (
        export GOPATH=$CACHE/go GOMODCACHE=$CACHE/go/pkg/mod GOBIN=$CACHE/go/bin GOCACHE=$CACHE/go/build
        export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-buildvcs=false -modcacherw"
        cd "$STATE" && exec go install -trimpath "$MINIO_MODULE@$MINIO_VERSION"
    ) >"$LOGS/minio-build.log" 2>&1 9>&- &
    BUILD_PID=$!
fi

# ---------------------------------------------------------------- Kafka
KAFKA_STARTED=0
if running "$KAFKA_PID" "kafka.Kafka"; then
    say "kafka already running (pid $(cat "$KAFKA_PID"))"
else
    rm -f "$KAFKA_PID"
    command -v java >/dev/null || die "Kafka needs Java 11+: no 'java' on PATH"
    POM_SUM=$(sha256sum infra/kafka/pom.xml | cut -c1-64)
    if [ "$(cat "$KAFKA_LIBS/.pom.sha256" 2>/dev/null)" != "$POM_SUM" ]; then
        command -v mvn >/dev/null || die "Kafka's jars come from Maven Central with Maven: no 'mvn' on PATH"
        say "fetching Kafka $KAFKA_VERSION jars with Maven (first run only) ..."
        rm -rf "$KAFKA_LIBS.tmp"
        mvn -q -B -Dstyle.color=never -Dmaven.repo.local="$CACHE/m2" -f infra/kafka/pom.xml \
            dependency:copy-dependencies -DoutputDirectory="$KAFKA_LIBS.tmp" >"$LOGS/kafka-deps.log" 2>&1 \
            || die "kafka: 'mvn dependency:copy-dependencies' failed for infra/kafka/pom.xml" "$LOGS/kafka-deps.log"
        [ -f "$KAFKA_LIBS.tmp/kafka_2.13-$KAFKA_VERSION.jar" ] \
            || die "kafka: Maven did not copy kafka_2.13-$KAFKA_VERSION.jar" "$LOGS/kafka-deps.log"
        echo "$POM_SUM" >"$KAFKA_LIBS.tmp/.pom.sha256"
        rm -rf "$KAFKA_LIBS" && mv "$KAFKA_LIBS.tmp" "$KAFKA_LIBS"
    fi
    JAVA_CP="$KAFKA_LIBS/*"
    JAVA_OPTS=(-Djava.awt.headless=true "-Dlog4j.configuration=file:$ROOT/infra/kafka/log4j.properties"
               "-Dkafka.logs.dir=$STATE/kafka-logs")

    mkdir -p "$STATE/kafka" "$KAFKA_DATA"
    sed "s:@KAFKA_DATA@:$KAFKA_DATA:" infra/kafka/server.properties >"$STATE/kafka/server.properties"
    if [ ! -f "$KAFKA_DATA/meta.properties" ]; then
        say "formatting Kafka storage (KRaft) in ${KAFKA_DATA#"$ROOT"/} ..."
        TOOL_OPTS=(-Djava.awt.headless=true "-Dlog4j.configuration=file:$ROOT/infra/kafka/tools-log4j.properties")
        CLUSTER_ID=$(java "${TOOL_OPTS[@]}" -cp "$JAVA_CP" kafka.tools.StorageTool random-uuid 2>>"$LOGS/kafka-format.log" | tail -n 1) \
            || die "kafka: 'kafka.tools.StorageTool random-uuid' failed" "$LOGS/kafka-format.log"
        java "${TOOL_OPTS[@]}" -cp "$JAVA_CP" kafka.tools.StorageTool format --ignore-formatted \
            -t "$CLUSTER_ID" -c "$STATE/kafka/server.properties" >>"$LOGS/kafka-format.log" 2>&1 \
            || die "kafka: 'kafka.tools.StorageTool format' failed" "$LOGS/kafka-format.log"
    fi
    for p in $KAFKA_PORT $KAFKA_CONTROLLER_PORT; do
        port_busy "$p" && die "kafka: port 127.0.0.1:$p is already in use by a process not started by infra/up.sh"
    done
    [ -f "$KAFKA_LOG" ] && mv -f "$KAFKA_LOG" "$KAFKA_LOG.1"
    # shellcheck disable=SC2086  # KAFKA_HEAP is a list of JVM flags
    setsid nohup java $KAFKA_HEAP -XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:InitiatingHeapOccupancyPercent=35 \
        -XX:+ExplicitGCInvokesConcurrent "${JAVA_OPTS[@]}" -cp "$JAVA_CP" \
        kafka.Kafka "$STATE/kafka/server.properties" >"$KAFKA_LOG" 2>&1 </dev/null 9>&- &
    echo $! >"$KAFKA_PID"
    KAFKA_STARTED=1
    say "kafka $KAFKA_VERSION starting (pid $(cat "$KAFKA_PID"), log ${KAFKA_LOG#"$ROOT"/})"
fi

# ---------------------------------------------------------------- MinIO
MINIO_STARTED=0
if [ "$MINIO_RUNNING" = 1 ]; then
    say "minio already running (pid $(cat "$MINIO_PID"))"
else
    rm -f "$MINIO_PID"
    if [ -n "$BUILD_PID" ]; then
        wait "$BUILD_PID" || die "minio: 'go install $MINIO_MODULE@$MINIO_VERSION' failed (kafka is left running; 'make infra-down' stops it)" "$LOGS/minio-build.log"
        minio_built || die "minio: the build finished but $MINIO_BIN is not version $MINIO_VERSION" "$LOGS/minio-build.log"
        say "minio built in $(elapsed)"
    fi
    for p in $MINIO_PORT $MINIO_CONSOLE_PORT; do
        port_busy "$p" && die "minio: port 127.0.0.1:$p is already in use by a process not started by infra/up.sh"
    done
    mkdir -p "$MINIO_DATA"
    [ -f "$MINIO_LOG" ] && mv -f "$MINIO_LOG" "$MINIO_LOG.1"
    # Credentials go through the environment, never the command line (visible in ps).
    MINIO_ROOT_USER=$ACCESS_KEY MINIO_ROOT_PASSWORD=$SECRET_KEY \
    MINIO_BROWSER=off MINIO_UPDATE=off MINIO_CALLHOME_ENABLE=off \
        setsid nohup "$MINIO_BIN" server --quiet --anonymous \
            --address "$MINIO_HOST:$MINIO_PORT" --console-address "$MINIO_HOST:$MINIO_CONSOLE_PORT" \
            "$MINIO_DATA" >"$MINIO_LOG" 2>&1 </dev/null 9>&- &
    echo $! >"$MINIO_PID"
    MINIO_STARTED=1
    say "minio starting (pid $(cat "$MINIO_PID"), log ${MINIO_LOG#"$ROOT"/})"
fi

# ---------------------------------------------------------------- health
"$PY" infra/health.py kafka "$KAFKA_HOST:$KAFKA_PORT" "$(cat "$KAFKA_PID")" "$TIMEOUT" 2>"$LOGS/kafka-health.err" &
KAFKA_CHECK=$!
MINIO_OK=1
STAGETREE_S3_ACCESS_KEY=$ACCESS_KEY STAGETREE_S3_SECRET_KEY=$SECRET_KEY \
    "$PY" infra/health.py minio "$MINIO_HOST:$MINIO_PORT" "$(cat "$MINIO_PID")" "$TIMEOUT" "$BUCKET" 2>"$LOGS/minio-health.err" \
    || MINIO_OK=0
KAFKA_OK=1
wait "$KAFKA_CHECK" || KAFKA_OK=0

FAILED=0
if [ "$KAFKA_OK" = 0 ]; then
    echo "infra-up: error: $(cat "$LOGS/kafka-health.err")" >&2
    tail_log "$KAFKA_LOG"
    FAILED=1
fi
if [ "$MINIO_OK" = 0 ]; then
    echo "infra-up: error: $(cat "$LOGS/minio-health.err")" >&2
    tail_log "$MINIO_LOG"
    FAILED=1
fi
[ "$FAILED" = 0 ] || { echo "infra-up: stop what did start with 'make infra-down'" >&2; exit 1; }

k=$([ "$KAFKA_STARTED" = 1 ] && echo started || echo "already running")
m=$([ "$MINIO_STARTED" = 1 ] && echo started || echo "already running")
say "ready in $(elapsed): kafka $KAFKA_VERSION on $KAFKA_HOST:$KAFKA_PORT ($k), minio on $MINIO_HOST:$MINIO_PORT bucket '$BUCKET' ($m); variables in ${ENV_FILE#"$ROOT"/}"

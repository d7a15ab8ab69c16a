"""Transport benchmark: the embedded RocksDB log vs Kafka, side by side in one run.

What it measures
----------------
1. **Projector fold throughput** (events/s). A realistic plan stream is generated with the real
   reducer and scheduler and simulated instant workers (``generate`` of benchmarks/replay.py:
   ``--trials`` step-decay schedules extended every ``--every`` steps until ``--events`` events
   exist). It is appended, in batches of 5,000, to an :class:`~events.log.EmbeddedLog` in a
   temporary directory and to a :class:`~events.kafka_log.KafkaLog` under a fresh topic prefix
   (append throughput, events/s, is shown too). Then
   ``Projector(log, store=ProjectionStore(fresh)).catch_up()`` is timed ``--fold-repeats`` times
   per transport, alternating which goes first: reading the stream, decoding, folding and
   committing the store; the median is reported. Both folds must give the same projection.
2. **Dispatch latency** (seconds, p50 and p99) from TrialSubmitted to StageStarted. A real small
   study (``--study``, default tests/studies/tiny_sha.py, 2 workers) runs ``--repeats`` times per
   transport, alternating which goes first: embedded (``stagetree run``: one coordinator
   process) and Kafka (the same command against the local broker and MinIO of ``infra/up.sh``;
   it starts ``stagetree serve`` and the workers itself). The plan stream is folded and every
   request (a TrialSubmitted: trial, steps -> terminal node in ``Trial.requests``) is paired with
   the first later StageDispatched that has a stage ending at that (node, steps), and with that
   dispatch's first StageStarted. Requests served by a checkpoint or by a path already in flight
   have no such dispatch and are counted apart. Latencies come from the events' ``ts`` (epoch
   seconds stamped by their producers on this one machine), pooled over the repeats, and are
   split into submitted -> dispatched (scheduler, plus queueing for an idle worker) and
   dispatched -> started (delivery to the worker plus loading the source checkpoint: a local
   directory when embedded, MinIO on Kafka). End-to-end seconds come from each summary.json.

Everything is printed as a ``rich`` table (embedded, Kafka, ratio Kafka / embedded) and written to
``OUT/transport.json``. Timings are wall-clock on this machine, which also runs the broker and
MinIO; read them as ratios measured side by side.

How to run
----------
::

    bash infra/up.sh   # once: Kafka on 127.0.0.1:9092 and MinIO, variables in .infra/env
    .venv/bin/python benchmarks/transport.py [--events 30000] [--repeats 2] [--out runs/bench-transport]

About 1.5-3 minutes on a 2-core machine. The run's topics (``bench-<hex>-fold.*``,
``bench-<hex>-study<i>.*``) are deleted at the end; its checkpoints stay in MinIO under
``s3://stagetree/bench-<hex>-study<i>``, and so does the faust leader topic each ``stagetree
serve`` creates (``stagetree-<study>-<hex>-__assignor-__leader``, not under the prefix).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Import from the repository root, not this folder (whose replay.py shadows the `replay` package).
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]

import orjson  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from benchmarks.replay import generate  # noqa: E402
from events import topics  # noqa: E402
from events.codec import encode  # noqa: E402
from events.kafka_log import KafkaLog  # noqa: E402
from events.log import EmbeddedLog, EventLog, event_key  # noqa: E402
from events.models import StageDispatched, StageStarted, TrialSubmitted  # noqa: E402
from projections.partitions import PartitionedFold  # noqa: E402
from projections.store import ProjectionStore, Projector, snapshot  # noqa: E402
from replay.audit import projection_digest  # noqa: E402

TRANSPORTS = ("embedded", "kafka")


def infra_env() -> dict[str, str]:
    """The ``export KEY=VALUE`` lines of ``.infra/env`` (written by infra/up.sh)."""
    env: dict[str, str] = {}
    for line in (ROOT / ".infra" / "env").read_text().splitlines():
        words = shlex.split(line, comments=True)
        for word in words[1:] if words[:1] == ["export"] else words:
            key, _, value = word.partition("=")
            env[key] = value
    return env


def append_all(log: EventLog, items: list[tuple[str, bytes]]) -> float:
    """Append ``items`` to the plan stream in batches of 5,000; seconds taken."""
    t0 = time.perf_counter()
    for i in range(0, len(items), 5000):
        log.append_many(topics.PLAN, items[i:i + 5000])
    return time.perf_counter() - t0


def time_fold(log: EventLog, store_path: Path) -> tuple[float, str]:
    """Seconds to fold the whole plan stream of ``log`` into a fresh store; the projection's digest."""
    store = ProjectionStore(store_path)
    gc.collect()
    try:
        t0 = time.perf_counter()
        projector = Projector(log, store=store, dead_letters=False)
        projector.catch_up()
        seconds = time.perf_counter() - t0
        return seconds, projection_digest(snapshot(projector.state))
    finally:
        store.close()


def dispatch_latencies(log: EventLog) -> dict[str, Any]:
    """Per request: TrialSubmitted -> StageDispatched -> first StageStarted of that dispatch (s),
    and ``unpaired``: how many requests no later dispatch trained (a checkpoint or a path in flight had them).
    Every partition of the plan stream is folded; a request, its dispatch and its start are in
    their plan's partition, in order."""
    fold = PartitionedFold(log, log.partition_count(topics.PLAN))
    applied = [(offset, event) for _, offset, event in fold.catch_up()]
    trials = fold.state.trials
    pending: dict[tuple[str, int], list[float]] = {}  # (node, step) -> ts of requests waiting
    dispatched: dict[str, tuple[float, list[float]]] = {}  # dispatch_id -> (ts, request ts)
    out: dict[str, Any] = {"submit_to_start": [], "submit_to_dispatch": [], "dispatch_to_start": []}
    for _, ev in applied:
        if isinstance(ev, TrialSubmitted):
            pending.setdefault((trials[ev.trial_id].requests[ev.steps], ev.steps), []).append(ev.ts)
        elif isinstance(ev, StageDispatched):
            waiting = [ts for s in ev.stages for ts in pending.pop((s.node_id, s.to_step), [])]
            if waiting:
                dispatched[ev.dispatch_id] = (ev.ts, waiting)
        elif isinstance(ev, StageStarted) and ev.dispatch_id in dispatched:
            dispatch_ts, waiting = dispatched.pop(ev.dispatch_id)
            out["submit_to_start"] += [ev.ts - ts for ts in waiting]
            out["submit_to_dispatch"] += [dispatch_ts - ts for ts in waiting]
            out["dispatch_to_start"].append(ev.ts - dispatch_ts)
    out["unpaired"] = sum(map(len, pending.values()))
    return out


def run_study(transport: str, study: Path, out: Path, env: dict[str, str], prefix: str) -> dict[str, Any]:
    """Run ``study`` on ``transport``; its end-to-end seconds and dispatch latencies."""
    shutil.rmtree(out, ignore_errors=True)
    run_env = {k: v for k, v in os.environ.items() if k != "STAGETREE_BOOTSTRAP_SERVERS"}
    if transport == "kafka":
        run_env |= env | {"STAGETREE_TOPIC_PREFIX": prefix,
                          "STAGETREE_CHECKPOINT_STORE": f"s3://stagetree/{prefix.rstrip('.')}"}
    cmd = [sys.executable, "-m", "stagetree.cli", "run", str(study), "--workers", "2", "--out", str(out), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=run_env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{transport} study failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    e2e = float(orjson.loads((out / "summary.json").read_bytes())["end_to_end_seconds"])
    log: EventLog = (EmbeddedLog(out / "log", read_only=True) if transport == "embedded"
                     else KafkaLog(env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=prefix))
    try:
        return {"end_to_end_seconds": e2e, "wall_seconds": wall, **dispatch_latencies(log)}
    finally:
        log.close()


def delete_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic whose name starts with ``prefix``; raises when one was not deleted."""
    with KafkaLog(bootstrap, client_id="stagetree-bench", create_topics=False) as log:
        failed = log.delete_topics(prefix)
    if failed:
        raise RuntimeError(f"topics under {prefix!r} were not deleted: {failed}")


def pct(xs: list[float], q: int) -> float:
    """The ``q``-th percentile of ``xs`` (linear interpolation)."""
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=30_000, help="events in the generated stream (at least)")
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--every", type=int, default=10, help="steps between a trial's successive requests")
    ap.add_argument("--fold-repeats", type=int, default=3)
    ap.add_argument("--study", default=str(ROOT / "tests" / "studies" / "tiny_sha.py"))
    ap.add_argument("--repeats", type=int, default=2, help="study runs per transport")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-transport"))
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = infra_env()
    bootstrap = env["STAGETREE_BOOTSTRAP_SERVERS"]
    run_id = f"bench-{uuid.uuid4().hex[:10]}"
    console = Console()

    console.print(f"generating a plan stream of >= {args.events:,} events ({args.trials} trials) ...")
    sim = generate(args.events, args.trials, args.every)
    items = [(event_key(e), encode(e)) for e in sim.events]
    fold: dict[str, dict[str, Any]] = {t: {"fold_seconds": []} for t in TRANSPORTS}
    digests: set[str] = set()
    try:
        with tempfile.TemporaryDirectory(prefix="stagetree-bench-") as tmp:
            logs: dict[str, EventLog] = {"embedded": EmbeddedLog(Path(tmp) / "log"),
                                         # one partition: the fold of one stream, as embedded
                                         "kafka": KafkaLog(bootstrap, topic_prefix=f"{run_id}-fold.",
                                                           plan_partitions=1)}
            for t, log in logs.items():
                fold[t]["append_events_per_second"] = len(items) / append_all(log, items)
            for r in range(args.fold_repeats):
                for t in TRANSPORTS if r % 2 == 0 else TRANSPORTS[::-1]:
                    log = logs[t]
                    console.print(f"fold {r + 1}/{args.fold_repeats} on {t} ...")
                    seconds, digest = time_fold(log, Path(tmp) / f"{t}-store{r}")
                    fold[t]["fold_seconds"].append(seconds)
                    digests.add(digest)
            for t, log in logs.items():
                fold[t]["fold_events_per_second"] = len(items) / statistics.median(fold[t]["fold_seconds"])
                log.close()
        same_projection = len(digests) == 1

        runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
        for i in range(args.repeats):
            for t in TRANSPORTS if i % 2 == 0 else TRANSPORTS[::-1]:
                console.print(f"study run {i + 1}/{args.repeats} on {t} ...")
                runs[t].append(run_study(t, Path(args.study), out / f"{t}{i}", env, f"{run_id}-study{i}."))
    finally:
        delete_topics(bootstrap, run_id)

    figures: dict[str, Any] = {"events": len(items), "trials": args.trials, "study": args.study,
                               "repeats": args.repeats, "same_projection": same_projection,
                               "fold": fold, "runs": runs, "summary": {}}
    rows: list[tuple[str, str, dict[str, float]]] = [
        ("append (events/s)", ",.0f", {t: fold[t]["append_events_per_second"] for t in TRANSPORTS}),
        ("projector fold (events/s)", ",.0f", {t: fold[t]["fold_events_per_second"] for t in TRANSPORTS}),
    ]
    for key, label in (("submit_to_start", "submitted -> started"),
                       ("submit_to_dispatch", "  submitted -> dispatched"),
                       ("dispatch_to_start", "  dispatched -> started")):
        pooled = {t: [x for r in runs[t] for x in r[key]] for t in TRANSPORTS}
        for q in (50, 99):
            rows.append((f"{label}, p{q} (s)", ".3f", {t: pct(pooled[t], q) for t in TRANSPORTS}))
    rows.append(("requests paired with a dispatch", ",.0f",
                 {t: sum(len(r["submit_to_start"]) for r in runs[t]) for t in TRANSPORTS}))
    rows.append(("requests without a dispatch", ",.0f",
                 {t: sum(r["unpaired"] for r in runs[t]) for t in TRANSPORTS}))
    rows.append(("study end-to-end, median (s)", ".2f",
                 {t: statistics.median(r["end_to_end_seconds"] for r in runs[t]) for t in TRANSPORTS}))
    rows.append(("study wall incl. start-up (s)", ".2f",
                 {t: statistics.median(r["wall_seconds"] for r in runs[t]) for t in TRANSPORTS}))

    table = Table(title=f"transport: embedded RocksDB log vs Kafka ({len(items):,} events folded; "
                        f"{args.repeats} x {Path(args.study).name} per transport)")
    for col, justify in (("figure", "left"), ("embedded", "right"), ("kafka", "right"), ("kafka / embedded", "right")):
        table.add_column(col, justify=justify)
    for label, spec, values in rows:
        ratio = values["kafka"] / values["embedded"] if values["embedded"] else None
        figures["summary"][label] = values | {"ratio": ratio}
        table.add_row(label, *(format(values[t], spec) for t in TRANSPORTS), "-" if ratio is None else f"{ratio:.2f}")
    console.print(table)
    console.print(f"same projection from both transports: {same_projection}")
    (out / "transport.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))
    console.print(f"written: {out / 'transport.json'}")


if __name__ == "__main__":
    main()

"""The control plane at paper scale: the real broker, the real ``stagetree serve``, forty
simulated GPUs, the 448-trial ResNet56 successive-halving study (Hippo Table 1).

What it measures
----------------
The study (``--study``, default ``examples/paper/resnet56_sha.py``) runs on the local Kafka of
``infra/up.sh`` against ``--workers`` worker processes (default 40) that do not import torch
(``python -m gpu_worker.simulated_worker``): each is a real ``stagetree worker`` (own dispatch
stream, transactional appends, heartbeats) whose steps take the time of the study's cost model
(``gpu_worker/simulation_models.py``) multiplied by a time scale chosen so that the study takes
about ``--minutes`` minutes. The study is submitted with ``stagetree run --workers 0``.

Twice, side by side in one run:

1. one ``stagetree serve`` instance;
2. two instances, and a kill -9 of the one holding the scheduler role halfway through (the
   other takes the role over: the takeover time is from the kill to the successor's "scheduler
   role taken over" line, i.e. fenced and caught up).

Each prints:

* makespan (``end_to_end_seconds`` of summary.json) / the makespan ``stagetree simulate``
  predicts for the same study and worker count, scaled by the same factor (goal <= 1.10);
* dispatch latency p50 / p99: StageFinished of a worker's last stage -> its next StageStarted
  (an idle worker getting work: scheduling, the transaction, delivery, loading), and
  TrialSubmitted -> the first StageStarted of the dispatch that trains it;
* StageDispatched -> that dispatch's first StageStarted (the control plane's own part: the
  decision's transaction, delivery on the worker's stream, the source checkpoint's load);
* plan-stream events per second over the makespan, and each serve process's CPU seconds per
  1,000 events while the study ran (read from /proc: user + system);
* with the kill: the takeover time.

How to run
----------
::

    bash infra/up.sh          # once: Kafka and MinIO, .infra/env
    .venv/bin/python benchmarks/cluster_load.py [--minutes 3] [--workers 40] [--json runs/bench-cluster.json]

About 2 x (--minutes + 1) minutes. Topics are created under a fresh prefix (``bench-<hex>-``)
and deleted at the end; the simulated checkpoints live in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
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

from benchmarks.transport import delete_topics, dispatch_latencies, infra_env, pct  # noqa: E402
from events import topics  # noqa: E402
from events.kafka_log import Follower, KafkaLog  # noqa: E402
from events.models import StageDispatched, StageFinished, StageStarted  # noqa: E402
from gpu_worker.simulated import models_of  # noqa: E402
from gpu_worker.simulation_models import models_to_json  # noqa: E402
from projections.partitions import PartitionedFold  # noqa: E402
from stagetree.simulate import simulate  # noqa: E402
from stagetree.simulate_cli import load_simulation  # noqa: E402

PY = sys.executable
CLI = [PY, "-m", "stagetree.cli"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def idle_to_start(events: list[Any]) -> list[float]:
    """Seconds from a worker's StageFinished of the last stage of its dispatch to its next
    StageStarted (the worker was idle in between), per worker, by the events' timestamps."""
    last_stage = {e.dispatch_id: (e.stages[-1].node_id, e.stages[-1].to_step)
                  for e in events if isinstance(e, StageDispatched)}
    per_worker: dict[str, list[Any]] = {}
    for e in events:
        if isinstance(e, (StageFinished, StageStarted)):
            per_worker.setdefault(e.worker_id, []).append(e)
    out = []
    for evs in per_worker.values():
        evs.sort(key=lambda e: e.ts)
        for a, b in zip(evs, evs[1:]):
            if isinstance(a, StageFinished) and isinstance(b, StageStarted) \
                    and last_stage.get(a.dispatch_id) == (a.node_id, a.to_step) and b.dispatch_id != a.dispatch_id:
                out.append(b.ts - a.ts)
    return out


class Scenario:
    """One deployment: serve instance(s), simulated workers, the study."""

    def __init__(self, name: str, args: argparse.Namespace, env: dict[str, str], tmp: Path, models: Path,
                 time_scale: float) -> None:
        self.name, self.args, self.tmp = name, args, tmp / name
        self.tmp.mkdir()
        self.prefix = f"{args.run_id}-{name}."
        self.env = {**env, "STAGETREE_TOPIC_PREFIX": self.prefix, "PYTHONUNBUFFERED": "1"}
        self.models, self.time_scale = models, time_scale
        self.procs: list[subprocess.Popen[bytes]] = []
        self.serves: dict[str, subprocess.Popen[bytes]] = {}
        self.cpu: dict[str, float] = {}

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        out = (self.tmp / log).open("ab")
        proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def log_text(self, name: str) -> str:
        return (self.tmp / name).read_text(errors="replace")

    def start(self, serves: int) -> None:
        kafka = ["--bootstrap-servers", self.env["STAGETREE_BOOTSTRAP_SERVERS"], "--plan-partitions",
                 str(self.args.partitions)]
        for i in range(serves):
            name = f"S{i}"
            self.serves[name] = self._spawn([*CLI, "serve", *kafka, "--state-dir", str(self.tmp / f"serve-{name}"),
                                             "--app-id", f"{self.prefix}app", "--instance-id", name], f"{name}.log")
        time.sleep(2)  # the plan topic exists (the first serve created it) before workers join
        for i in range(self.args.workers):
            self._spawn([PY, "-m", "gpu_worker.simulated_worker", *kafka, "--worker-id", f"g{i:02d}",
                         "--models", str(self.models), "--time-scale", repr(self.time_scale),
                         "--checkpoints", str(self.tmp / "checkpoints")], f"g{i:02d}.log")
        self.wait_joined()

    def wait_joined(self, timeout: float = 600) -> None:
        with KafkaLog(self.env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=self.prefix) as log:
            log.ensure_topic(topics.PLAN)
            n = log.partition_count(topics.PLAN)
            fold, follower = PartitionedFold(log, n), Follower(log, {(topics.PLAN, p): 0 for p in range(n)})
            deadline = time.monotonic() + timeout
            try:
                while sum(w.alive for w in fold.state.workers.values()) < self.args.workers:
                    assert time.monotonic() < deadline, "the simulated workers did not join"
                    fold.fold(follower.poll(0.5))
            finally:
                follower.close()

    def active_serve(self) -> str:
        """The serve instance whose decision is the latest in the log."""
        with KafkaLog(self.env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=self.prefix) as log:
            decisions = [e for e in _events(log) if isinstance(e, StageDispatched)]
        return max(decisions, key=lambda e: e.ts).producer.removeprefix("serve:")

    def run_study(self, kill_after: float | None) -> dict[str, Any]:
        out = self.tmp / "run"
        started = time.monotonic()
        at_start = {name: cpu_seconds(proc.pid) for name, proc in self.serves.items()}
        run = subprocess.Popen([*CLI, "run", self.args.study, "--bootstrap-servers",
                                self.env["STAGETREE_BOOTSTRAP_SERVERS"], "--workers", "0", "--out", str(out),
                                "--quiet"], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        killed: dict[str, Any] = {}
        if kill_after is not None:
            while time.monotonic() - started < kill_after and run.poll() is None:
                time.sleep(0.5)
            victim = self.active_serve()
            self.cpu[victim] = cpu_seconds(self.serves[victim].pid) - at_start[victim]
            killed = {"instance": victim, "at": time.time()}
            os.killpg(self.serves[victim].pid, signal.SIGKILL)
        _, err = run.communicate(timeout=3 * 3600)
        if run.returncode != 0:
            raise RuntimeError(f"stagetree run failed: {err.decode()[-3000:]}")
        for name, proc in self.serves.items():
            if proc.poll() is None:
                self.cpu[name] = cpu_seconds(proc.pid) - at_start[name]
        summary = orjson.loads((out / "summary.json").read_bytes())
        if killed:
            times = [float(t) for name in self.serves if name != killed["instance"]
                     for t in re.findall(r"scheduler role taken over at ([0-9.]+)", self.log_text(f"{name}.log"))]
            after = [t for t in times if t > killed["at"]]
            killed["takeover_seconds"] = min(after) - killed["at"] if after else None
        return {"summary": summary, "killed": killed}

    def stop(self) -> None:
        serves = set(self.serves.values())
        for group in ([p for p in self.procs if p not in serves], [p for p in self.procs if p in serves]):
            for p in group:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def _events(log: KafkaLog) -> list[Any]:
    from events.codec import InvalidEvent, decode

    out = []
    for p in range(log.partition_count(topics.PLAN)):
        for r in log.read(topics.PLAN, partition=p):
            try:
                out.append(decode(r.value))
            except InvalidEvent:
                continue
    return out


def measure(scenario: Scenario, serves: int, kill_after: float | None, predicted_wall: float) -> dict[str, Any]:
    scenario.start(serves)
    try:
        outcome = scenario.run_study(kill_after)
    finally:
        scenario.stop()
    with KafkaLog(scenario.env["STAGETREE_BOOTSTRAP_SERVERS"], topic_prefix=scenario.prefix) as log:
        events = _events(log)
        latencies = dispatch_latencies(log)
    summary = outcome["summary"]
    makespan = summary["end_to_end_seconds"]
    plan_events = len(events)
    idle = idle_to_start(events)
    return {
        "serves": serves,
        "makespan_seconds": makespan,
        "predicted_seconds": predicted_wall,
        "makespan_ratio": makespan / predicted_wall,
        "idle_to_start_p50": pct(idle, 50), "idle_to_start_p99": pct(idle, 99), "idle_to_start_n": len(idle),
        "submit_to_start_p50": pct(latencies["submit_to_start"], 50),
        "submit_to_start_p99": pct(latencies["submit_to_start"], 99),
        "submit_to_start_n": len(latencies["submit_to_start"]),
        "dispatch_to_start_p50": pct(latencies["dispatch_to_start"], 50),
        "dispatch_to_start_p99": pct(latencies["dispatch_to_start"], 99),
        "plan_events": plan_events,
        "events_per_second": plan_events / makespan,
        "serve_cpu_seconds": scenario.cpu,
        "cpu_seconds_per_1000_events": {k: 1000 * v / plan_events for k, v in scenario.cpu.items()},
        "executed_steps": summary["executed_steps"], "unique_steps": summary["unique_steps"],
        "trials": len(summary["trials"]),
        "killed": outcome["killed"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default=str(ROOT / "examples" / "paper" / "resnet56_sha.py"))
    ap.add_argument("--workers", type=int, default=40)
    ap.add_argument("--minutes", type=float, default=3.0, help="wall minutes the study should take (default 3)")
    ap.add_argument("--partitions", type=int, default=8, help="partitions of stagetree.plan (default 8)")
    ap.add_argument("--no-failover", action="store_true", help="only the one-serve run")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    args.run_id = f"bench-{uuid.uuid4().hex[:8]}"
    console = Console()
    env = {**os.environ, **infra_env()}

    trainer, studies, _ = load_simulation(args.study)
    predicted = simulate(trainer, studies, workers=args.workers).makespan_seconds
    time_scale = args.minutes * 60 / predicted
    console.print(f"{Path(args.study).name}: {args.workers} simulated GPUs; stagetree simulate predicts "
                  f"{predicted / 3600:.1f} GPU-cluster hours, run at x{time_scale:.2e} "
                  f"({predicted * time_scale:.0f} s)")
    cost, curve = models_of(trainer)
    tmp = Path(tempfile.mkdtemp(prefix="stagetree-cluster-load-"))
    models = tmp / "models.json"
    models.write_bytes(orjson.dumps(models_to_json(cost, curve)))
    results: dict[str, Any] = {"study": args.study, "workers": args.workers, "time_scale": time_scale,
                               "predicted_virtual_seconds": predicted, "runs": {}}
    try:
        console.print("run 1: one serve instance ...")
        results["runs"]["one serve"] = measure(Scenario("one", args, env, tmp, models, time_scale), 1, None,
                                               predicted * time_scale)
        if not args.no_failover:
            console.print("run 2: two serve instances, kill -9 of the active one halfway ...")
            results["runs"]["two serves, kill -9"] = measure(
                Scenario("two", args, env, tmp, models, time_scale), 2, predicted * time_scale / 2,
                predicted * time_scale)
    finally:
        delete_topics(env["STAGETREE_BOOTSTRAP_SERVERS"], args.run_id)
        shutil.rmtree(tmp, ignore_errors=True)

    table = Table(title=f"control plane at paper scale: {Path(args.study).name}, {args.workers} simulated GPUs")
    table.add_column("figure")
    for name in results["runs"]:
        table.add_column(name, justify="right")
    runs = list(results["runs"].values())

    def row(label: str, fmt: str, get: Any) -> None:
        table.add_row(label, *[format(get(r), fmt) if get(r) is not None else "-" for r in runs])

    row("makespan (s)", ".1f", lambda r: r["makespan_seconds"])
    row("predicted by stagetree simulate (s)", ".1f", lambda r: r["predicted_seconds"])
    row("makespan / predicted (goal <= 1.10)", ".3f", lambda r: r["makespan_ratio"])
    row("idle worker -> next StageStarted, p50 (s)", ".3f", lambda r: r["idle_to_start_p50"])
    row("idle worker -> next StageStarted, p99 (s)", ".3f", lambda r: r["idle_to_start_p99"])
    row("TrialSubmitted -> first StageStarted, p50 (s)", ".3f", lambda r: r["submit_to_start_p50"])
    row("TrialSubmitted -> first StageStarted, p99 (s)", ".3f", lambda r: r["submit_to_start_p99"])
    row("  StageDispatched -> its StageStarted, p50 (s)", ".3f", lambda r: r["dispatch_to_start_p50"])
    row("  StageDispatched -> its StageStarted, p99 (s)", ".3f", lambda r: r["dispatch_to_start_p99"])
    row("plan-stream events", ",d", lambda r: r["plan_events"])
    row("events / s", ".1f", lambda r: r["events_per_second"])
    for i in range(2):
        row(f"serve S{i}: CPU s per 1,000 events", ".2f", lambda r, i=i: r["cpu_seconds_per_1000_events"].get(f"S{i}"))
    row("takeover after kill -9 (s)", ".1f", lambda r: (r["killed"] or {}).get("takeover_seconds"))
    row("executed steps / unique steps", ".3f", lambda r: r["executed_steps"] / r["unique_steps"])
    console.print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

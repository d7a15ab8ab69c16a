"""Replay-verify throughput and tracing overhead (issue: replay CLI and OpenTelemetry traces).

1. Generates a log of at least ``--events`` events (default 100,000) with the real reducer and
   scheduler and simulated instant workers (scheduler/simulation.py): ``--trials`` trials of
   step-decay schedules, each extended by successive requests every ``--every`` steps, as a
   long successive-halving study would. Writes it to an embedded RocksDB log, then times
   ``replay verify`` on it (hash chain, every dispatch decision recomputed from its prefix,
   projection rebuilt and compared, checkpoints skipped: the simulated ones do not exist) and
   the plain projection fold, in events per second, against the rate of decoding the same
   records with orjson alone (issue 15 goal 4: verify at least a fifth of it, the fold at least
   half) and with orjson and pydantic's validation (``events.codec.decode``, what a fold that
   validates every record cannot beat). The orjson rate is measured before and after each of
   the others (best of ``--passes`` passes) and each ratio uses the two around it. These
   rates are in CPU seconds of this process (on a shared machine, wall-clock time also counts
   the time other work held the cores). The simulation is dropped before the timings, as a
   ``replay verify`` process holds none.
2. Runs a real study (``--study``, default tests/studies/tiny_sha.py) with tracing off and with
   the JSONL exporter on, alternating, ``--repeats`` times each, and reports the end-to-end
   seconds (from summary.json) and the on/off ratio.

Run: ``.venv/bin/python benchmarks/replay.py [--events 100000] [--repeats 2]``. Prints a table
and writes ``OUT/replay.json``. The study timings are wall-clock seconds on this machine; read
every figure as a ratio measured side by side in one run.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# This file is named like the `replay` package: keep its own folder off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import orjson  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from events import topics  # noqa: E402
from events.codec import decode as decode_event  # noqa: E402
from events.codec import encode  # noqa: E402
from events.hp import Constant, MultiStep  # noqa: E402
from events.log import EmbeddedLog, event_key  # noqa: E402
from events.models import StageDispatched  # noqa: E402
from replay.audit import fold, open_source, verify  # noqa: E402
from scheduler.simulation import Simulation  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def generate(events: int, trials: int, every: int) -> Simulation:
    """Simulate until at least ``events`` events exist."""
    sim = Simulation(workers=4)
    configs = [
        {"lr": MultiStep(0.1, (m,), g), "bs": Constant(b)}
        for m in range(every * 5, every * 5 * (trials // 8 + 2), every * 5)
        for g in (0.1, 0.2)
        for b in (32, 64, 128, 256)
    ][:trials]
    step = every
    while len(sim.events) < events:
        for i, hp in enumerate(configs):
            sim.submit(f"t{i}", hp, step)
        sim.run()
        step += every
    return sim


def write_log(sim: Simulation, path: Path) -> int:
    log = EmbeddedLog(path / "log", sync=False)
    try:
        batch: list[tuple[str, bytes]] = []
        for ev in sim.events:
            batch.append((event_key(ev), encode(ev)))
            if len(batch) == 5000:
                log.append_many(topics.PLAN, batch)
                batch = []
        if batch:
            log.append_many(topics.PLAN, batch)
        return log.end_offset(topics.PLAN)
    finally:
        log.close()


def run_study(study: Path, out: Path, otel: str | None) -> float:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "stagetree.cli", "run", str(study), "--workers", "2", "--out", str(out), "--quiet"]
    if otel:
        cmd += ["--otel-exporter", otel]
    subprocess.run(cmd, check=True, capture_output=True, timeout=1800)
    return float(orjson.loads((out / "summary.json").read_bytes())["end_to_end_seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--study", default=str(ROOT / "tests" / "studies" / "tiny_sha.py"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--passes", type=int, default=3,
                    help="passes over the records for each decoding rate (the best one counts)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench-replay"))
    args = ap.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    console = Console()

    t0 = time.perf_counter()
    sim = generate(args.events, args.trials, args.every)
    gen_s = time.perf_counter() - t0
    n = write_log(sim, out / "generated")
    dispatches = sum(isinstance(e, StageDispatched) for e in sim.events)
    nodes = sum(len(p.nodes) for p in sim.state.plans.values())
    del sim
    gc.collect()

    source = open_source(out / "generated")
    # the floor: merely decoding every record's JSON with orjson (issue 15 goal 4: verify at least
    # a fifth of this rate, the fold at least half). This machine's speed drifts between seconds,
    # so it is measured (best of --passes passes, a pass takes a few tens of milliseconds) right
    # before and after each rate it is compared with, and each ratio uses the mean of those two.
    records = [r for stream in source.streams.values() for r in stream]

    def seconds(run: Callable[[], object], passes: int = 1) -> float:
        best = float("inf")
        for _ in range(passes):
            t0 = time.process_time()
            run()
            best = min(best, time.process_time() - t0)
        return best

    def orjson_pass() -> None:
        for r in records:
            orjson.loads(r.value)

    def validate_pass() -> None:  # decoding as the fold must: orjson, then pydantic's validation
        for r in records:
            decode_event(r.value)

    result = None

    def verify_pass() -> None:
        nonlocal result
        result = verify(source)

    decode_s = [seconds(orjson_pass, args.passes)]
    verify_s = seconds(verify_pass)
    assert result is not None and result.ok, result and result.first_failure
    decode_s.append(seconds(orjson_pass, args.passes))
    fold_s = seconds(lambda: fold(source.streams[topics.PLAN]))
    decode_s.append(seconds(orjson_pass, args.passes))
    # the most any fold that validates its records can reach
    validate_s = seconds(validate_pass, args.passes)
    decode_s.append(seconds(orjson_pass, args.passes))
    orjson_rate = [len(records) / s for s in decode_s]

    off: list[float] = []
    on: list[float] = []
    for i in range(args.repeats):
        off.append(run_study(Path(args.study), out / f"off{i}", None))
        on.append(run_study(Path(args.study), out / f"on{i}", f"jsonl:{out / f'spans{i}.jsonl'}"))
    figures = {
        "events": n,
        "dispatch_decisions": dispatches,
        "plan_nodes": nodes,
        "generate_seconds": gen_s,
        "verify_seconds": verify_s,
        "verify_events_per_second": n / verify_s,
        "fold_events_per_second": n / fold_s,
        "decode_events_per_second": statistics.median(orjson_rate),
        "decode_events_per_second_passes": orjson_rate,
        "validate_events_per_second": len(records) / validate_s,
        "validate_vs_decode": (len(records) / validate_s) / statistics.mean(orjson_rate[2:4]),
        "verify_vs_decode": (n / verify_s) / statistics.mean(orjson_rate[0:2]),
        "fold_vs_decode": (n / fold_s) / statistics.mean(orjson_rate[1:3]),
        "e2e_tracing_off_seconds": off,
        "e2e_tracing_on_seconds": on,
        "tracing_overhead_ratio": statistics.median(on) / statistics.median(off) if off else None,
    }
    table = Table(title="replay verify and tracing overhead")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("events in the generated log", f"{n:,}")
    table.add_row("dispatch decisions recomputed", f"{dispatches:,}")
    table.add_row("plan nodes", f"{nodes:,}")
    table.add_row("replay verify (all checks)", f"{n / verify_s:,.0f} events/s ({verify_s:.1f} s)")
    table.add_row("projection fold alone", f"{n / fold_s:,.0f} events/s ({fold_s:.1f} s)")
    table.add_row("orjson decode of the same records (median of 4)",
                  f"{figures['decode_events_per_second']:,.0f} records/s "
                  f"({min(orjson_rate):,.0f} to {max(orjson_rate):,.0f})")
    table.add_row("decode + pydantic validation (codec.decode)", f"{len(records) / validate_s:,.0f} records/s")
    table.add_row("validated / decode rate (the ceiling of a validating fold)", f"{figures['validate_vs_decode']:.3f}")
    table.add_row("verify / decode rate (goal >= 0.2)", f"{figures['verify_vs_decode']:.3f}")
    table.add_row("fold / decode rate (goal >= 0.5)", f"{figures['fold_vs_decode']:.3f}")
    if off:
        table.add_row("study e2e, tracing off (median)", f"{statistics.median(off):.2f} s")
        table.add_row("study e2e, tracing on, jsonl (median)", f"{statistics.median(on):.2f} s")
        table.add_row("tracing on / off", f"{figures['tracing_overhead_ratio']:.3f}")
    console.print(table)
    (out / "replay.json").write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

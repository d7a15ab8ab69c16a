"""Dashboard benchmark: following a running embedded log, and the cost of a view.

What it measures
----------------
1. **Following the log beside its writer** (milliseconds per poll, and the ratio). A writer
   process appends batches of ``--batch`` encoded MetricsReported events (about 250 bytes each,
   ``sync=True``, as the coordinator does) to an :class:`~events.log.EmbeddedLog` until it holds
   ``--records`` records. Meanwhile the reader polls every ``--interval`` seconds both ways, side
   by side, alternating which goes first: (a) a follower (``EmbeddedLog(follow=True)``, a RocksDB
   secondary instance) that catches up with the writer and reads the records after its last one,
   what ``stagetree dashboard`` does; (b) opening the log read-only anew and reading the same
   tail. Both must see the same records. Reported: median, p90 and max per poll, and the ratio
   (b) / (a); then one poll of each on the finished log.
2. **A view** (seconds, bytes). A paper-scale study (``--study``, default
   examples/paper/resnet56_sha.py: 448 trials) is simulated into a run directory; its plan
   stream is folded into a :class:`~stagetree.dashboard.views.LiveProjection` and the study's
   view computed (:func:`~stagetree.dashboard.views.study_view`) and serialized, as the server
   does for each update it pushes.

How to run
----------
::

    .venv/bin/python benchmarks/dashboard_follow.py [--records 60000] [--batch 20] [--interval 0.1]

About half a minute on a 2-core machine. Timings are wall-clock; read them as the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from events import topics  # noqa: E402
from events.codec import encode  # noqa: E402
from events.log import EmbeddedLog  # noqa: E402
from events.models import MetricsReported  # noqa: E402


def _writer(path: str, records: int, batch: int, ready: mp.synchronize.Event) -> None:
    log = EmbeddedLog(path)
    value = encode(MetricsReported(producer="worker:w0", dispatch_id="d" * 16, plan_key="p" * 32, node_id="n12",
                                   step=120, metrics={"val_acc": 0.9721, "val_loss": 0.1234}))
    ready.set()
    for _ in range(0, records, batch):
        log.append_many(topics.PLAN, [("p" * 32, value)] * batch)
        time.sleep(0.001)
    log.close()


def _poll_follower(log: EmbeddedLog, start: int) -> int:
    log.catch_up()
    records = list(log.read(topics.PLAN, start))
    return records[-1].offset + 1 if records else start


def _poll_reopen(path: Path, start: int) -> int:
    log = EmbeddedLog(path, read_only=True)
    try:
        records = list(log.read(topics.PLAN, start))
    finally:
        log.close()
    return records[-1].offset + 1 if records else start


def _figures(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": 1e3 * statistics.median(ordered), "p90_ms": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
            "max_ms": 1e3 * ordered[-1]}


def follow(records: int, batch: int, interval: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="stagetree-bench-follow-") as tmp:
        path = Path(tmp) / "log"
        ready = mp.get_context("spawn").Event()
        writer = mp.get_context("spawn").Process(target=_writer, args=(str(path), records, batch, ready))
        writer.start()
        ready.wait(60)
        follower = EmbeddedLog(path, follow=True)
        times: dict[str, list[float]] = {"follower": [], "reopen": []}
        at = {"follower": 0, "reopen": 0}
        polls = 0
        try:
            while True:
                alive = writer.is_alive()
                order = ("follower", "reopen") if polls % 2 == 0 else ("reopen", "follower")
                for way in order:
                    t = time.perf_counter()
                    at[way] = _poll_follower(follower, at[way]) if way == "follower" else _poll_reopen(path, at[way])
                    times[way].append(time.perf_counter() - t)
                polls += 1
                if not alive:
                    break
                time.sleep(interval)
            writer.join()
            assert at["follower"] == at["reopen"] == records, at
            t = time.perf_counter()
            _poll_follower(follower, records)
            idle_follower = time.perf_counter() - t
            t = time.perf_counter()
            _poll_reopen(path, records)
            idle_reopen = time.perf_counter() - t
        finally:
            follower.close()
    out: dict[str, object] = {"records": records, "polls": polls, **{w: _figures(s) for w, s in times.items()},
                              "finished_log_follower_ms": 1e3 * idle_follower,
                              "finished_log_reopen_ms": 1e3 * idle_reopen}
    out["ratio_median"] = out["reopen"]["median_ms"] / out["follower"]["median_ms"]  # type: ignore[index]
    return out


def view(study: str) -> dict[str, object]:
    from gpu_worker.loader import load_module
    from stagetree.dashboard.source import RunDirSource
    from stagetree.dashboard.views import LiveProjection, default_study, study_view
    from stagetree.simulate_cli import run_simulation

    with tempfile.TemporaryDirectory(prefix="stagetree-bench-view-") as tmp:
        load_module(study)  # fail early on a bad path
        run_simulation(study, workers=None, policy="critical-path", modes=["merged"], out=tmp)
        run_dir = next(p for p in Path(tmp).iterdir() if (p / "log").is_dir())
        source = RunDirSource(run_dir)
        try:
            t = time.perf_counter()
            live = LiveProjection()
            live.fold(source.poll())
            fold_s = time.perf_counter() - t
        finally:
            source.close()
        chosen = default_study(live)
        assert chosen is not None
        t = time.perf_counter()
        payload = orjson.dumps(study_view(live, chosen, str(run_dir)))
        view_s = time.perf_counter() - t
    return {"study": study, "records": live.records, "trials": len(live.state.trials), "fold_seconds": fold_s,
            "view_seconds": view_s, "payload_bytes": len(payload)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=60_000)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.1)
    p.add_argument("--study", default=str(ROOT / "examples" / "paper" / "resnet56_sha.py"))
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    figures = {"follow": follow(args.records, args.batch, args.interval), "view": view(args.study)}
    f, v = figures["follow"], figures["view"]
    print(f"following a log growing to {f['records']:,} records, {f['polls']} polls each way:")
    for way, name in (("follower", "follower (secondary catch-up)"), ("reopen", "read-only reopen")):
        s = f[way]  # type: ignore[index]
        print(f"  {name:32s} median {s['median_ms']:7.2f} ms  p90 {s['p90_ms']:7.2f} ms  max {s['max_ms']:7.2f} ms")
    print(f"  ratio reopen / follower (median): {f['ratio_median']:.1f}x")
    print(f"  one poll of the finished log: follower {f['finished_log_follower_ms']:.2f} ms, "
          f"reopen {f['finished_log_reopen_ms']:.2f} ms")
    print(f"view of {Path(str(v['study'])).name}: {v['trials']} trials, {v['records']:,} records folded in "
          f"{v['fold_seconds']:.2f} s; one view in {v['view_seconds']:.2f} s, {v['payload_bytes']:,} bytes of JSON")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps(figures, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()

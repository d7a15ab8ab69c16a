"""A worker's cost per stage beyond training, and its memory next to bare torch (issue 15,
goals 2 and 5).

What it measures
----------------
Everything runs the real worker code (``gpu_worker.executor.PathExecutor`` over
``events.execution.run_path``: checkpoints encoded, hashed, written durably to a
``LocalCheckpointStore`` under ``--out`` and verified, events stamped and encoded as they go to
the coordinator's pipe), in one process on one CPU thread, without a coordinator:

1. **tiny model** (``benchmarks/studies/trivial.py``'s one-weight trainer), ``--stages`` stages of
   one step each: (a) as one dispatched path (a checkpoint at every stage end, written while the
   next stage trains), (b) as that many one-stage paths from a fresh start (every trial of
   ``benchmarks/trivial_trials.py``), handed on at each path's end (PathTrained) and, as workers
   did before, waiting at each path's end for its durable write. Per stage, from
   the StageFinished events: ``seconds - train_seconds`` (the worker's overhead), median and p90;
   and the wall time per stage of the whole loop.
2. **100 MB checkpoint** (``benchmarks/studies/tree_100mb.py``'s trainer: a
   ``torch.nn.Linear(5000, 5000)`` without bias, plain SGD: 100,000,000 bytes of weights),
   stages of ``--big-steps`` steps (default 10) resumed from each other: the overhead (load of
   the source for the first stage, save, hash, durable write, verify; the writes overlap the
   next stage's training) as seconds and as a share of the stage, for a path from a fresh start,
   a sibling of its last stage loaded from the checkpoint before it (into the trainer already
   built with the seed; the store's first load, whose memory file is new) and one of its second
   stage (the next load), two more paths from a fresh start (the second build's state is kept,
   the third restores it) and a path loaded after the worker dropped its trainer (built again
   beside the read, as after a failed path); and each stage's wall time beyond the median of
   three bare stages (the same steps in a plain loop, no worker, measured first in the same
   process): the writer thread's competition for the CPU slows training, which ``seconds -
   train_seconds`` does not show (it falls inside ``train_seconds``). Both paths run twice: as
   the workers run them, whose path's last stage hands the worker on with PathTrained while its
   writes are verified (the end batches follow), and as workers did before that, whose path's
   last stage holds the worker until every write of the path is verified (so it also counts that
   wait).
3. **resident memory**: the peak RSS (``ru_maxrss``) of a fresh process that runs the worker on
   the 100 MB model for two stages, next to a fresh process that imports torch and trains the
   same model the same number of steps with a plain loop (goal: within 1.5x).

Usage::

    .venv/bin/python benchmarks/worker_overhead.py [--stages 1000] [--big-steps 10] [--out runs/bench-worker] \\
        [--device cuda:0] [--store s3://BUCKET/PREFIX [--s3-latency-ms 10] [--s3-rate-mb-s 100] \\
        [--checkpoint-cache]] \\
        [--cases tiny,big,memory]

``--store`` puts the checkpoints of cases 1 and 2 in an S3 store, as workers on a cluster do
(``S3CheckpointStore``: a save uploads the encoded bytes in one PUT whose sha256 the store
verifies, the checkpoints queued for the writer up to 8 uploads at once; a load downloads, a
large checkpoint in 8 ranged GETs at once, and hashes), each worker under a new prefix; the
endpoint and credentials come from the ``STAGETREE_S3_*`` variables (the local MinIO of
``infra/up.sh``: ``source .infra/env``). ``--s3-latency-ms MS`` holds every response of that
store MS milliseconds on its way, and ``--s3-rate-mb-s MB`` passes each connection's responses
at most MB megabytes per second (Toxiproxy in front of the endpoint, built on first use:
``benchmarks/network_latency.py``), as an object store across a network answers.
``--checkpoint-cache`` puts each worker's S3 store behind a node cache of the checkpoints it
saves and downloads (``gpu_worker/checkpoint_cache.py``, in a fresh directory under ``--out``):
its loads of them read the local copy; case 2 then also loads a checkpoint whose copy it deleted
(as if another node had saved it: downloaded, a copy kept) and, once that copy is written, the
same checkpoint again. ``--cases``
runs some of the three cases (``tiny,big,memory``).

Prints a table and writes ``OUT/worker_overhead.json``. Timings are wall seconds on this
machine; read them as ratios and shares within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

BIG_STUDY = ROOT / "benchmarks" / "studies" / "tree_100mb.py"  # its trainer: Linear(WIDTH, WIDTH), no bias


def _big_width() -> int:
    """The big study's ``WIDTH``: its checkpoint holds ``WIDTH * WIDTH * 4`` bytes of weights."""
    from gpu_worker.loader import load_module

    return int(load_module(BIG_STUDY).WIDTH)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _store(store: str | None, store_dir: Path, cache: bool = False) -> Any:
    """A fresh checkpoint store: ``store_dir`` emptied (``store`` None), or a new prefix under the
    ``s3://BUCKET/PREFIX`` URL ``store`` (:func:`gpu_worker.object_store.open_checkpoint_store`,
    its endpoint and credentials from the ``STAGETREE_S3_*`` variables), behind a node cache in
    ``store_dir`` emptied (``cache``: :class:`gpu_worker.checkpoint_cache.CachedCheckpointStore`,
    its default budget)."""
    from gpu_worker.checkpoint_cache import cached
    from gpu_worker.object_store import open_checkpoint_store

    if store is None or cache:
        shutil.rmtree(store_dir, ignore_errors=True)
    if store is None:
        return open_checkpoint_store(store_dir)
    remote = open_checkpoint_store(f"{store.rstrip('/')}/{store_dir.name}-{uuid.uuid4().hex[:12]}")
    return cached(remote, store_dir if cache else None, None)


def _forget(executor: Any, events: list[Any]) -> None:
    """Delete the checkpoints named in ``events`` from an S3 store (each worker of this benchmark
    writes under a prefix of its own, which nothing reads afterwards); a local store's directory
    is emptied by the next :func:`_store` and kept under ``--out`` after the last."""
    from events.models import CheckpointSaved
    from gpu_worker.checkpoint_cache import CachedCheckpointStore
    from gpu_worker.object_store import S3CheckpointStore

    if isinstance(executor.store, (S3CheckpointStore, CachedCheckpointStore)):
        for ref in {e.ref for e in events if isinstance(e, CheckpointSaved)}:
            executor.store.delete(ref)


def _executor(trainer: Any, store_dir: Path, device: Any, store: str | None = None, cache: bool = False) -> Any:
    import torch

    from gpu_worker.executor import PathExecutor
    from gpu_worker.process import warm_up

    torch.set_num_threads(1)
    checkpoints = _store(store, store_dir, cache)
    warm_up(trainer, device)
    return PathExecutor(trainer, "w0", checkpoints, device)


def _run(executor: Any, dispatches: list[Any], hand_off: bool = True) -> tuple[float, list[Any], list[Any]]:
    """Run each dispatch as the worker does (decoded from its bytes, events encoded for the pipe);
    wall seconds (until every end batch went out), the StageFinished events and every event.
    ``hand_off``: as the workers run them, a path's end does not wait for its writes (PathTrained;
    its end batches go out while the next path runs); else it waits, as workers did before."""
    from events.codec import decode, encode, encode_batch
    from events.execution import EndBatches
    from events.models import StageFinished

    raws = [encode(d) for d in dispatches]
    emitted: list[Any] = []

    def emit(events: list[Any]) -> None:
        encode_batch(events)
        emitted.extend(events)

    ends = EndBatches(emit) if hand_off else None
    t0 = time.perf_counter()
    for raw in raws:
        executor.run(decode(raw), emit, ends=ends)
    if ends is not None:
        ends.release(True)
    wall = time.perf_counter() - t0
    return wall, [e for e in emitted if isinstance(e, StageFinished)], emitted


def _dispatch(i: int, stages: list[tuple[str, dict[str, Any], int, int, bool]], source: Any = None) -> Any:
    from events.models import StageDispatched, StageSpec

    return StageDispatched(dispatch_id=f"d{i}", worker_id="w0", plan_key="bench", seed=0, decided_at=i,
                           source=source, stages=[StageSpec(node_id=n, hp=hp, from_step=a, to_step=b, evaluate=e)
                                                  for n, hp, a, b, e in stages])


def tiny(stages: int, out: Path, device: str = "cpu", store: str | None = None, cache: bool = False
         ) -> dict[str, Any]:
    from events.hp import Constant
    from gpu_worker.executor import resolve_device
    from gpu_worker.loader import load_trainer

    dev = resolve_device(device)
    trainer = load_trainer(ROOT / "benchmarks" / "studies" / "trivial.py")
    hp = {"target": Constant(0.5)}
    figures: dict[str, Any] = {}
    fresh = [_dispatch(i, [(f"n{i}", {"target": Constant(i / stages)}, 0, 1, True)]) for i in range(stages)]
    cases = {
        "one path of one-step stages": ([_dispatch(0, [(f"n{s}", hp, s, s + 1, False) for s in range(stages)])], True),
        "one-step paths from a fresh start": (fresh, True),
        "one-step paths from a fresh start, each end waits for its write": (fresh, False),
    }
    for name, (dispatches, hand_off) in cases.items():
        executor = _executor(trainer, out / "tiny", dev, store, cache)
        wall, finished, events = _run(executor, dispatches, hand_off)
        _forget(executor, events)
        overhead = [1000 * (e.seconds - e.train_seconds) for e in finished]
        figures[name] = {"stages": len(finished), "wall_ms_per_stage": 1000 * wall / len(finished),
                         "overhead_ms_median": statistics.median(overhead), "overhead_ms_p90": _quantile(overhead, 0.9),
                         "train_ms_median": statistics.median(1000 * e.train_seconds for e in finished)}
    return figures


def big(steps: int, out: Path, device: str = "cpu", store: str | None = None, cache: bool = False
        ) -> dict[str, Any]:
    from events.hp import Constant
    from events.models import CheckpointSaved, CheckpointSource
    from gpu_worker.executor import resolve_device
    from gpu_worker.loader import load_trainer

    out.mkdir(parents=True, exist_ok=True)
    trainer = load_trainer(BIG_STUDY)
    hp = {"lr": Constant(0.01)}
    dev = resolve_device(device)
    bare = _bare_stage_seconds(trainer, steps, dev)
    rows: list[tuple[Any, str, bool, bool]] = []  # (StageFinished, how it started, path end, handed off)
    for hand_off in (True, False):
        executor = _executor(trainer, out / "big", dev, store, cache)  # a worker of its own for each way
        # a path of 3 stages from a fresh start; a sibling of its last stage, loaded from the
        # checkpoint before it into the trainer built for the first path; then a path resumed from
        # the first path's last checkpoint by a worker that must build its trainer again
        written: list[Any] = []  # every event of this worker's paths

        def run(dispatch: Any, executor: Any = executor, written: list[Any] = written,
                hand_off: bool = hand_off) -> list[Any]:
            _, finished, events = _run(executor, [dispatch], hand_off)
            written.extend(events)
            return finished

        first = run(_dispatch(0, [(f"n{s}", hp, s * steps, (s + 1) * steps, False) for s in range(3)]))
        refs = [e.ref for e in written if isinstance(e, CheckpointSaved)]
        sibling = run(_dispatch(1, [("s2", {"lr": Constant(0.02)}, 2 * steps, 3 * steps, False)],
                                CheckpointSource(node_id="n1", step=2 * steps, ref=refs[1])))
        cousin = run(_dispatch(5, [("c1", {"lr": Constant(0.03)}, steps, 2 * steps, False)],
                               CheckpointSource(node_id="n0", step=steps, ref=refs[0])))
        downloaded: list[Any] = []
        if cache:  # the last checkpoint as if another node had saved it: no copy here
            executor.store.copies_written()
            executor.store.path(refs[2]).unlink(missing_ok=True)  # (none when the backlog was full)
            from_n2 = CheckpointSource(node_id="n2", step=3 * steps, ref=refs[2])
            downloaded = run(_dispatch(6, [("e3", {"lr": Constant(0.04)}, 3 * steps, 4 * steps, False)], from_n2))
            executor.store.copies_written()  # (the copier thread may take longer than a stage on a busy CPU)
            downloaded += run(_dispatch(7, [("f3", {"lr": Constant(0.05)}, 3 * steps, 4 * steps, False)], from_n2))
        kept = run(_dispatch(3, [("r0", {"lr": Constant(0.02)}, 0, steps, False)]))
        root = run(_dispatch(4, [("q0", {"lr": Constant(0.03)}, 0, steps, False)]))
        executor.abandon()  # as a worker that failed a path (or ran another trainer) would
        resumed = run(_dispatch(2, [("m0", hp, 3 * steps, 4 * steps, False)],
                                CheckpointSource(node_id="n2", step=3 * steps, ref=refs[2])))
        executor.abandon()
        _forget(executor, written)
        rows += [(e, "fresh start" if e is first[0] else "continued in memory", e is first[-1], hand_off)
                 for e in first]
        rows += [(sibling[0], "loaded from a checkpoint into the trainer built before, the store's first load", True,
                  hand_off),
                 (cousin[0], "loaded from a checkpoint into the trainer built before", True, hand_off),
                 *[(e, how, True, hand_off) for e, how in zip(downloaded, (
                     "loaded from a checkpoint another node saved: downloaded, its copy kept while it trains",
                     "loaded again from that checkpoint: its copy kept on download"))],
                 (kept[0], "fresh start, built again and its state kept", True, hand_off),
                 (root[0], "fresh start, the trainer's state after its build restored", True, hand_off),
                 (resumed[0], "loaded from a checkpoint, trainer built again", True, hand_off)]
    return {"checkpoint_bytes": _big_width() ** 2 * 4, "steps_per_stage": steps, "bare_stage_seconds": bare,
            "stages": [{"from_step": e.from_step, "how": how, "seconds": e.seconds, "train_seconds": e.train_seconds,
                        "overhead_s": e.seconds - e.train_seconds,
                        "overhead_share": (e.seconds - e.train_seconds) / e.seconds,
                        "beyond_bare_share": (e.seconds - statistics.median(bare)) / e.seconds,
                        "path_end": end, "handed_off": hand_off} for e, how, end, hand_off in rows]}


def _bare_stage_seconds(trainer: Any, steps: int, device: Any, repeats: int = 3) -> list[float]:
    """Seconds of ``steps`` plain training steps of ``trainer`` (no worker, nothing written beside
    them), ``repeats`` times: what a stage's training costs when nothing competes with it for
    the CPU. ``seconds - train_seconds`` leaves out the slowdown of training by the writer thread
    (it falls inside ``train_seconds``); ``seconds`` against this does not."""
    import torch

    torch.set_num_threads(1)  # as the worker trains (_executor), whichever case ran first
    trainer.build(0, device)
    indices = torch.empty(0, dtype=torch.int64)
    timings = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for step in range(steps):
            trainer.train_step(indices, step)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - t0)
    return timings


MEMORY_WORKER = """
import resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from benchmarks.worker_overhead import big
big(int(sys.argv[2]), Path(sys.argv[3]))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

MEMORY_BARE = """
import resource, sys, torch
torch.set_num_threads(1)
width = int(sys.argv[2])
model = torch.nn.Linear(width, width, bias=False)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(4 * int(sys.argv[1])):
    loss = model(torch.randn(64, width)).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def memory(steps: int, out: Path) -> dict[str, float]:
    def peak(code: str, *args: str) -> float:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                              check=False)
        if proc.returncode != 0:
            raise SystemExit(f"memory probe failed:\n{proc.stderr[-2000:]}")
        return float(proc.stdout.split()[-1])

    worker = peak(MEMORY_WORKER, str(ROOT), str(steps), str(out / "memory"))
    bare = peak(MEMORY_BARE, str(steps), str(_big_width()))
    return {"worker_peak_rss_bytes": worker, "bare_torch_peak_rss_bytes": bare, "ratio": worker / bare}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=1000)
    p.add_argument("--big-steps", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-worker")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda:N: where the worker trains (the memory probe stays on cpu)")
    p.add_argument("--store", default=None, metavar="s3://BUCKET/PREFIX",
                   help="checkpoints in this S3 store (MinIO: endpoint and credentials from STAGETREE_S3_*, "
                        "e.g. `source .infra/env`), each worker under a new prefix; default a local directory "
                        "under --out (the memory probe stays local)")
    p.add_argument("--s3-latency-ms", type=int, default=None, metavar="MS",
                   help="with --store: every response of the store held MS milliseconds on its way (Toxiproxy in "
                        "front of the endpoint, benchmarks/network_latency.py), as an object store across a network")
    p.add_argument("--s3-rate-mb-s", type=int, default=None, metavar="MB",
                   help="with --store: each connection's responses passed at most MB megabytes per second "
                        "(Toxiproxy's bandwidth toxic), as S3 serves one connection")
    p.add_argument("--checkpoint-cache", action="store_true",
                   help="with --store: each worker's S3 store behind a node cache of the checkpoints it saves and "
                        "downloads, in a fresh directory under --out (gpu_worker/checkpoint_cache.py)")
    p.add_argument("--cases", default="tiny,big,memory",
                   help="which cases to run, comma-separated among tiny, big, memory (default all)")
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - {"tiny", "big", "memory"}:
        p.error(f"--cases must name some of tiny, big, memory, got {args.cases!r}")
    if args.s3_latency_ms is not None and (args.store is None or args.s3_latency_ms < 0):
        p.error(f"--s3-latency-ms ({args.s3_latency_ms}) needs --store and must be >= 0")
    if args.s3_rate_mb_s is not None and (args.store is None or args.s3_rate_mb_s < 1):
        p.error(f"--s3-rate-mb-s ({args.s3_rate_mb_s}) needs --store and must be >= 1")
    if args.checkpoint_cache and args.store is None:
        p.error("--checkpoint-cache needs --store (a local store's checkpoints are local already)")
    if args.stages < 1 or args.big_steps < 1:
        p.error(f"--stages ({args.stages}) and --big-steps ({args.big_steps}) must be >= 1")
    from gpu_worker.executor import resolve_device

    try:
        resolve_device(args.device)
    except ValueError as exc:
        p.error(str(exc).replace("`device`", "--device", 1))
    if args.store is not None and not args.store.startswith("s3://"):
        p.error(f"--store must be an s3://BUCKET/PREFIX URL, got {args.store!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        if args.s3_latency_ms is not None or args.s3_rate_mb_s is not None:
            from benchmarks.network_latency import delayed_endpoint

            endpoint = os.environ.get("STAGETREE_S3_ENDPOINT", "")
            os.environ["STAGETREE_S3_ENDPOINT"] = stack.enter_context(delayed_endpoint(
                endpoint, args.s3_latency_ms or 0, None if args.s3_rate_mb_s is None else 1000 * args.s3_rate_mb_s))
        result: dict[str, Any] = {"device": args.device, "store": args.store or "local",
                                  "checkpoint_cache": args.checkpoint_cache,
                                  "s3_latency_ms": args.s3_latency_ms, "s3_rate_mb_s": args.s3_rate_mb_s}
        if "tiny" in cases:
            result["tiny"] = tiny(args.stages, args.out, args.device, args.store, args.checkpoint_cache)
        if "big" in cases:
            result["big"] = big(args.big_steps, args.out, args.device, args.store, args.checkpoint_cache)
        if "memory" in cases:
            result["memory"] = memory(args.big_steps, args.out)
    (args.out / "worker_overhead.json").write_text(json.dumps(result, indent=2))

    where = f"checkpoints in {args.store}" if args.store else "durable local checkpoints"
    if args.s3_latency_ms is not None:
        where += f", {args.s3_latency_ms} ms added to each of its responses"
    if args.s3_rate_mb_s is not None:
        where += f", each connection at most {args.s3_rate_mb_s} MB/s"
    if args.checkpoint_cache:
        where += ", behind a node cache of the worker's checkpoints"
    table = Table(title=f"worker overhead per stage on {args.device} (one CPU thread, {where})")
    table.add_column("case")
    table.add_column("overhead per stage, median (p90)", justify="right")
    table.add_column("wall per stage", justify="right")
    for name, f in result.get("tiny", {}).items():
        table.add_row(f"tiny model: {name} ({f['stages']})", f"{f['overhead_ms_median']:.2f} ms "
                      f"({f['overhead_ms_p90']:.2f} ms)", f"{f['wall_ms_per_stage']:.2f} ms")
    if "big" in result:
        bare = statistics.median(result["big"]["bare_stage_seconds"])
        for s in result["big"]["stages"]:
            how = s["how"]
            if s["path_end"]:
                how += ", path end: " + ("PathTrained, its writes follow" if s["handed_off"]
                                         else "waits for its writes")
            elif not s["handed_off"]:
                how += ", in a path whose end waits"
            table.add_row(f"100 MB checkpoint, {args.big_steps} steps from step {s['from_step']} ({how})",
                          f"{s['overhead_s']:.3f} s = {100 * s['overhead_share']:.1f} % of the stage",
                          f"{s['seconds']:.2f} s ({100 * s['beyond_bare_share']:+.0f} % beyond bare)")
        table.add_row(f"100 MB model, {args.big_steps} plain training steps, no worker (bare), median of "
                      f"{len(result['big']['bare_stage_seconds'])}", "", f"{bare:.2f} s")
    if "memory" in result:
        m = result["memory"]
        table.add_row("peak RSS: worker / bare torch, same model and steps",
                      f"{m['worker_peak_rss_bytes'] / 2**20:,.0f} / {m['bare_torch_peak_rss_bytes'] / 2**20:,.0f} MiB",
                      f"{m['ratio']:.2f}x (goal <= 1.5x)")
    Console(width=150).print(table)
    print(f"wrote {args.out / 'worker_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

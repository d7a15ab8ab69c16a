"""The ``stagetree`` command.

``stagetree run FILE [--workers N] [--out DIR] [--no-merge] [--resume]`` runs the study defined
in FILE (module-level ``trainer`` and ``tuner``, optional ``seed`` and ``name``) in embedded
mode, shows live progress, and writes ``DIR/summary.json``. A DIR whose log holds other studies
takes a new one without --resume: its events join the same log, and when its plan key equals an
earlier study's it shares that study's search plan (Hippo §7) and is answered from its steps.

Exit codes: 0 success; 1 the study ran but a trial failed (after writing its summary) or the run
broke; 2 bad input (study file, flags, run directory), reported before anything is created.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import math
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import orjson

from events import topics
from events.errors import LogError
from replay.commands import register
from stagetree.dashboard.cli import port_number, reserve
from stagetree.dashboard.cli import register as register_dashboard
from stagetree.errors import RuntimeError_, TrialFailed, TrialsFailed, UsageError
from stagetree.export.commands import register as register_export
from stagetree.simulate_cli import register as register_simulate
from stagetree.sizes import parse_size
from stagetree.words import counted

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Coroutine

    from rich.console import Console

    from events.kafka_log import KafkaLog
    from events.log import EmbeddedLog
    from events.models import StudyStarted
    from stagetree.dashboard.cli import Beside
    from stagetree.state_lock import StateDirLock
    from stagetree.tuners import Tuner, TunerResult
    from stagetree.worker_processes import PrestartedWorkers

T = TypeVar("T")

# Everything else is imported by the command that uses it: importing this module and building
# the parser must stay cheap (tests/test_public_api.py checks what it imports): every command
# pays for it before its work, `stagetree run` before it starts its workers, and every worker
# process imports this module again (multiprocessing runs the parent's main module in each).


def _study_file(path: str) -> tuple[Any, Any, Tuner, int, str]:
    from gpu_worker.loader import StudyFileError, load_module, trainer_of
    from stagetree.spaces import unshared_by_type
    from stagetree.study import validate_config
    from stagetree.tuners import Tuner

    module = load_module(path)
    trainer = trainer_of(module, path)
    tuner = getattr(module, "tuner", None)
    if not isinstance(tuner, Tuner):
        raise StudyFileError(f"study file {path!r} must define `tuner` as a stagetree Tuner, got {tuner!r}")
    seed = getattr(module, "seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise StudyFileError(f"study file {path!r}: `seed` is {seed!r}, but must be an int in [0, 2**63)")
    try:
        tuner.check(trainer)
    except ValueError as exc:
        raise StudyFileError(f"study file {path!r}: the tuner: {exc}") from None
    configs = []
    for i, config in enumerate(tuner.space):
        try:
            configs.append(validate_config(trainer, config))
        except ValueError as exc:
            raise StudyFileError(f"study file {path!r}: configuration {i} of the tuner's space: {exc}") from None
    name = getattr(module, "name", Path(path).stem)
    if not isinstance(name, str) or not name:
        raise StudyFileError(f"study file {path!r}: `name` is {name!r}, but must be a non-empty string")
    _warn_unshared(path, unshared_by_type(configs))  # an adaptive space (Optuna's) lists none here
    return module, trainer, tuner, seed, name


def _settings_of(path: str, tuner: Tuner) -> dict[str, Any]:
    """The tuner's settings as its StudyStarted records them
    (:func:`stagetree.tuners._settings.recorded_settings`).

    Raises:
        UsageError: they cannot be recorded (naming the study file), before anything is created.
    """
    from stagetree.tuners._settings import recorded_settings

    try:
        return recorded_settings(tuner)
    except ValueError as exc:
        raise UsageError(f"study file {path!r}: {exc}") from None


def _warn_unshared(path: str, unshared: dict[str, tuple[Any, Any]]) -> None:
    """A warning on stderr per hyper-parameter that starts at one number written as two types."""
    if not unshared:
        return
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, soft_wrap=True, emoji=False)
    for hp, (a, b) in unshared.items():
        err.print(f"[yellow]warning:[/yellow] study file {escape(repr(path))}: `{escape(hp)}` starts at {a!r} "
                  f"({type(a).__name__}) in some configurations and {b!r} ({type(b).__name__}) in others: those "
                  "trials share no step (values must be the same type to be shared); write them all as one type")


async def _conduct(runtime: Any, log: Any, args: argparse.Namespace, loaded: tuple[Any, Any, Any, int, str],
                   settings: dict[str, Any], mode: str) -> dict[str, Any]:
    """Run the tuner of a loaded study file on a ready runtime; returns the summary. ``settings``:
    its tuner's (:meth:`Tuner.settings`), recorded in StudyStarted.

    End-to-end time runs from the ready cluster to the answer, plus earlier incarnations' of the
    same study (other studies on the same log do not count, see :func:`projections.summary.elapsed`).
    """
    from events.models import StudyFinished, StudyStarted
    from projections.summary import build_summary, elapsed_before, plan_events
    from stagetree.progress import Progress
    from stagetree.study import Study

    _, trainer, tuner, seed, name = loaded
    started = time.monotonic()

    def check(prior: dict[str, Any] | None) -> None:
        if prior is not None and prior["mode"] != mode:
            raise UsageError(_mode_mismatch(name, prior["mode"], mode))
        if prior is not None:
            _same_plan(args.file, name, "the log", prior, trainer, seed)
        _same_tuner(args.file, name, "the log", prior and prior.get("tuner_settings"), settings)

    check(runtime.state.studies.get(name))  # before a claim: a refused file stops no other client
    claim = getattr(runtime, "claim", None)
    if claim is not None:  # on Kafka: fence an earlier client of the study, then read all it wrote
        claim()
    prior = runtime.state.studies.get(name)
    check(prior)
    before = elapsed_before(log, name) if prior is not None else 0.0
    study = Study(runtime, name, trainer, seed, merge=mode == "merged", metric=tuner.metric)
    if prior is not None:  # its tuner decides again from the start, as replay verify does: in memory
        study.writes_tuner_state, study.continues = False, True
        if getattr(tuner.space, "storage", None) is not None:
            from rich.console import Console

            Console(stderr=True).print(
                f"[yellow]note:[/yellow] study {name!r} continues: its Optuna study is kept in memory for this run, "
                "and the one in `storage` is brought up to date when the tuner ends")
    runtime.append([StudyStarted(producer="cli", study_id=name, name=name, plan_key=study.plan_key, mode=mode,
                                 workers=args.workers, seed=seed, trainer=f"{trainer.name}@{trainer.version}",
                                 metric=tuner.metric, metric_mode=tuner.mode,
                                 study_file=str(Path(args.file).resolve()), tuner_settings=settings)])
    progress = Progress(lambda: runtime.state, f"{name} ({mode}, {counted(args.workers, 'worker')})",
                        enabled=not args.quiet, study_id=name)
    runtime.on_fold.append(progress.on_fold)
    with progress:
        try:
            result: TunerResult = await tuner.run(study)
        except Exception:
            if study.failure is not None:  # a tuner's `metric` the trainer does not report: exit 2
                raise type(study.failure)(f"study file {args.file!r}: {study.failure}") from None
            raise
        study.flush()  # its last decision (the answer) before StudyFinished
        await runtime.drain()
    e2e = before + (time.monotonic() - started)
    answer = result.answer  # best_step: the evaluation's step (MLtunerTuner's may precede the trial's last)
    runtime.append([StudyFinished(producer="cli", study_id=name, **answer._asdict(), end_to_end_seconds=e2e,
                                  plan_key=study.plan_key)])
    return build_summary(runtime.state, name, mode=mode, workers=args.workers, **answer._asdict(),
                         end_to_end_seconds=e2e, events=plan_events(log))


def _mode_mismatch(name: str, held: str, mode: str) -> str:
    """Why study ``name``, whose log holds a run in mode ``held`` ("merged" or "trial"), cannot
    continue in ``mode``, with the flag that resumes it: the hint names what to type, not what was
    typed."""
    return (f"the log holds a {held!r} run of {name!r}; it cannot continue as {mode!r}: resume it "
            f"{'with' if held == 'trial' else 'without'} --no-merge")


def _same_plan(file: str, name: str, where: str, recorded: dict[str, Any], trainer: Any, seed: int) -> None:
    """Refuse (exit 2) a continuation of study ``name`` whose study file now gives another plan
    than its earlier run ``recorded`` (its StudyStarted's fields): another seed or trainer
    (name, version, constants, batch-size settings) is another plan, where its trials would all
    be refused (or, on a deployment, its requests made anew under the old name)."""
    from stagetree.study import plan_key_of

    if plan_key_of(trainer, seed) != recorded["plan_key"]:
        raise UsageError(
            f"study file {file!r}: study {name!r} in {where} ran with seed {recorded['seed']} and trainer "
            f"{recorded['trainer']!r}, but the file now gives seed {seed} and trainer "
            f"{trainer.name + '@' + trainer.version!r} (or other constants or batch-size settings): that is "
            "another study; give it another `name`, or restore the file")


def _same_tuner(file: str, name: str, where: str, recorded: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    """Refuse (exit 2) a continuation of study ``name`` with the tuner ``settings``
    (:meth:`Tuner.settings`) when its earlier run ``recorded`` other ones (None: it recorded
    none): another tuner, other arguments or another space would mix two studies' decisions in
    one."""
    from events.settings import difference

    why = None if recorded is None else difference(recorded, settings)
    if why is not None:
        raise UsageError(f"study file {file!r}: study {name!r} in {where} ran with other tuner settings ({why}): "
                         "that is another study; restore the file, or give it another `name` (run beside the first, "
                         "without --resume, it shares the plan: steps already trained are not trained again)")


def _write_summary(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """Write the study's ``summary-<study>.json``, and ``summary.json`` when the directory has
    none or it is this study's: a study never overwrites another study's summary."""
    from projections.summary import summary_path

    out.mkdir(parents=True, exist_ok=True)
    data = orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS)
    path = summary_path(out, summary["name"])
    path.write_bytes(data)
    main = out / "summary.json"
    try:
        owner = orjson.loads(main.read_bytes()).get("name") if main.is_file() else None
    except (orjson.JSONDecodeError, AttributeError):
        owner = None
    if owner is None or owner == summary["name"]:
        main.write_bytes(data)
        path = main
    return summary | {"out": str(out), "summary_file": str(path)}


def _out_dir(out: str | None, name: str) -> Path:
    """The run directory: ``--out``, else ``runs/<name>`` (the study's name made one file name,
    so that a name such as ``../x`` stays under ``runs/``). An empty ``--out`` is refused."""
    from projections.summary import file_safe

    if out is not None and not out.strip():
        raise UsageError(f"--out is {out!r}, but must name a run directory")
    return Path(out) if out is not None else Path("runs") / file_safe(name)


def _check_out(out: Path) -> None:
    """Refuse a ``--out`` that cannot be a directory, before anything is created (exit 2)."""
    from stagetree.outputs import check_output_dir

    check_output_dir("--out", out)


def _check_device(spec: str, flag: str = "--device") -> None:
    """Refuse a device this machine cannot train on, before anything is created (exit 2)."""
    from gpu_worker.executor import resolve_device  # torch

    try:
        resolve_device(spec)
    except ValueError as exc:
        raise UsageError(str(exc).replace("`device`", flag, 1)) from None  # "--device is 'x', but ..."


def _studies_in(log: EmbeddedLog) -> tuple[dict[str, StudyStarted], set[str]]:
    """The studies started in the embedded log ``log`` (opened read-only): id -> its first
    StudyStarted (its mode, ``merged`` or ``trial``, its plan key, seed and trainer), and the ids
    of those whose last run finished (a StudyFinished after their last StudyStarted)
    (undecodable records are skipped; they hold no study)."""
    from events.models import StudyFinished, StudyStarted
    from projections.summary import plan_events

    studies: dict[str, StudyStarted] = {}
    finished: set[str] = set()
    for e in plan_events(log):
        if isinstance(e, StudyStarted):
            studies.setdefault(e.study_id, e)
            finished.discard(e.study_id)
        elif isinstance(e, StudyFinished):
            finished.add(e.study_id)
    return studies, finished


def _check_projection(out: Path, log: EmbeddedLog) -> None:
    """Refuse (exit 2) a run directory whose projection (``state/``) has folded plan records its
    log (``log/``) no longer holds, or other ones: the log lost its tail (damage, a power loss)
    or was replaced. Resuming there would append new records at offsets the projection has
    already folded, so it skipped them and waited for ever, or, opening a log whose metadata is
    damaged for writing, let RocksDB drop its table files. ``log``: ``out/log`` opened
    read-only; nothing is written."""
    from projections.store import ProjectionStore

    if not (out / "state" / "CURRENT").is_file():
        return
    store = ProjectionStore(out / "state", read_only=True)
    try:
        offset, chain = store.position()
    finally:
        store.close()
    end = log.end_offset(topics.PLAN)
    record = next(iter(log.read(topics.PLAN, offset, offset + 1)), None) if 0 <= offset < end else None
    if offset < 0 or (record is not None and record.chain.hex() == chain):
        return
    why = (f"its projection (state/) has folded the plan stream up to offset {offset}, but log/ holds "
           f"{end} records" if offset >= end else
           f"the plan record at offset {offset} of log/ is not the one its projection (state/) folded there")
    raise UsageError(f"--out {str(out)!r}: {why}: the log lost records (damage, a power loss) or was replaced. "
                     "Nothing was changed. Restore log/ from a copy, or move state/ away to continue from what "
                     "log/ holds (the projection is rebuilt from it); `stagetree replay verify` says what differs")


async def _run_embedded(args: argparse.Namespace, console: Console, prestarted: PrestartedWorkers
                        ) -> dict[str, Any]:
    """Run the study in ``--out``: a new directory, the same study again (``--resume``), or a new
    study appended to a log that holds other studies (sharing their plan when the keys match).

    Every flag and the directory are checked before anything is created (exit 2, naming the
    flag and the value). ``--resume`` continues the study's own run; in a directory that holds
    no run yet (a run killed before its log had a study) it starts the run; in a directory
    whose runs are all of other studies it is refused (adding a study is done without it).
    ``prestarted``: the workers :func:`cmd_run` started first.
    """
    import asyncio

    from events.keys import secret_from
    from events.log import EmbeddedLog, held_elsewhere
    from events.shared_log import owned_here
    from replay.anchor import log_anchor
    from stagetree.embedded import EmbeddedCoordinator

    loaded = _study_file(args.file)
    name = loaded[4]
    settings = _settings_of(args.file, loaded[2])  # once: a grid's digest reads every configuration
    out = _out_dir(args.out, name)
    _check_out(out)
    _check_device(args.device)
    if owned_here(out / "log"):  # before held_elsewhere, which would drop this process's own locks on it
        raise UsageError(f"study file {args.file!r} opens the log of --out {str(out)!r} itself (an Optuna journal "
                         "storage on the run directory?): a run and a study file cannot both own it; keep the "
                         "Optuna journal in another directory")
    has_log = (out / "log" / "CURRENT").is_file()
    if has_log and held_elsewhere(out / "log"):  # a run still starting holds no study yet
        raise UsageError(f"--out {str(out)!r}: the log is open in another process (a run of this directory is "
                         "still going); wait for it to end, or choose another --out")
    studies: dict[str, StudyStarted] = {}
    finished: set[str] = set()
    if has_log:  # read once, without writing or locking anything
        log = EmbeddedLog(out / "log", read_only=True)
        try:
            _check_projection(out, log)
            studies, finished = _studies_in(log)
        finally:
            log.close()
    if args.resume and studies and name not in studies:
        raise UsageError(f"--resume: {str(out)!r} holds no run of study {name!r} (it holds "
                         f"{', '.join(map(repr, sorted(studies)))}); to add study {name!r} to this directory, "
                         "run it without --resume")
    if not args.resume:
        if name in studies:
            raise UsageError(f"--out {str(out)!r} already holds a run of study {name!r}; pass --resume to continue "
                             "it, or choose another --out (or another `name` in the study file)")
        if has_log and not studies:
            raise UsageError(f"--out {str(out)!r} already holds a run that never started a study; pass --resume "
                             "to start it there, or choose another --out")
    mode = "trial" if args.no_merge else "merged"
    if name in studies and studies[name].mode != mode:
        raise UsageError(_mode_mismatch(name, studies[name].mode, mode))
    if name in studies:
        recorded = studies[name]
        _same_plan(args.file, name, repr(str(out)), recorded.payload(), loaded[1], loaded[3])
        _same_tuner(args.file, name, repr(str(out)), recorded.tuner_settings, settings)
    if args.resume and name in finished:  # nothing to resume: its tuner's decisions are all in the log
        from projections.summary import summary_path
        from replay.report.load import load_run

        path = summary_path(out, name)
        try:
            kept = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            kept = None
        if isinstance(kept, dict) and kept.get("name") == name:
            console.print(f"study {name!r} in {str(out)!r} has finished: nothing to resume")
            return kept | {"out": str(out), "summary_file": str(path)}
        console.print(f"study {name!r} in {str(out)!r} has finished: nothing to resume; its summary file "
                      f"{str(path)!r} is missing or unreadable, so it is computed again from the log")
        return _write_summary(out, load_run(out, name).summary or {})
    budget = args.checkpoint_budget if args.checkpoint_budget is not None else _budget_default()
    port = reserve(args.dashboard) if args.dashboard is not None else None
    try:  # the last check: a directory that cannot be made (no parent, no permission)
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        from stagetree.state_lock import mkdir_failure

        raise UsageError(f"--out {str(out)!r} cannot be created: {mkdir_failure(out, exc)}") from None
    dashboard = None
    try:
        async with EmbeddedCoordinator(out, args.file, args.workers, device=args.device,
                                       secret=secret_from(args.log_key), checkpoint_budget=budget,
                                       prestarted=prestarted, start_method=prestarted.method) as coord:
            if port is not None:  # the log exists now: the dashboard follows it while workers start
                dashboard = await asyncio.get_running_loop().run_in_executor(
                    None, _start_dashboard, str(out), port, secret_from(args.log_key), console)
            await coord.ready()
            summary = await _conduct(coord, coord.log, args, loaded, settings, mode)
            anchor = log_anchor(coord.log)  # after its StudyFinished
            summary["log_anchor"] = None if anchor is None else str(anchor)
    finally:
        if dashboard is not None:
            dashboard.stop()
    return _write_summary(out, summary)


def _start_dashboard(where: str, port: int, secret: bytes | None, console: Console) -> Beside | None:
    """Start ``stagetree dashboard`` beside the run and print its address; a dashboard that
    fails to start is reported and the run goes on without it."""
    from rich.markup import escape

    from stagetree.dashboard.cli import Beside, DashboardError

    dashboard = Beside(where, port, secret)
    try:
        url = dashboard.start()
    except DashboardError as exc:
        console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}; the run goes on without it")
        return None
    console.print(f"dashboard: {url} (stops with the run; `stagetree dashboard {escape(where)}` shows it later)")
    return dashboard


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """A ``stagetree`` process that ``run`` starts (its serve, a worker): it is sent SIGTERM
    (a worker drains, a serve leaves) when the run dies, even by SIGKILL, rather than going on
    re-parented for ever (Linux's ``PR_SET_PDEATHSIG``; run's main thread starts every one)."""
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "stagetree.cli", *args], start_new_session=False,
                            preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (1): Linux only
    except (OSError, AttributeError):  # another system: the run's own stop still stops them
        pass


class Stopped(Exception):
    """``stagetree run`` was stopped by a signal: exit ``code``, as a shell reports a process the
    signal ended (143: SIGTERM, 130: SIGINT, Ctrl-C)."""

    def __init__(self, message: str, code: int = 143) -> None:
        super().__init__(message)
        self.code = code


class _StopSignals:
    """While ``run`` on Kafka runs: SIGTERM (kill, systemd, a batch scheduler) and SIGINT (Ctrl-C)
    cancel the study ``task``, so the processes it started are stopped and its serve app's
    topics deleted (Python's default for SIGTERM ended the client alone, its serve and workers
    left running), and tell the logs in :attr:`logs` to give up appends that wait for the broker
    (``KafkaLog.stop_requested``). The handlers are Python-level ones (not the loop's): they run
    even while the loop is held by an append that retries through an outage. A second signal
    raises KeyboardInterrupt at once. The previous handlers are restored on exit."""

    def __init__(self, task: Any) -> None:
        self.task = task
        self.received: signal.Signals | None = None
        self.logs: list[Any] = []

    def __enter__(self) -> _StopSignals:
        self.previous = {sig: signal.signal(sig, self._on) for sig in (signal.SIGTERM, signal.SIGINT)}
        return self

    def _on(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum)
        for log in self.logs:
            log.stop_requested = True
        self.task.cancel()
        self.task.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop if it waits

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def stopped(self, started: bool) -> Stopped:
        """The error that reports the stop by :attr:`received` (``started``: the run started a
        serve and workers, stopped with it)."""
        how = "Ctrl-C (SIGINT)" if self.received == signal.SIGINT else "SIGTERM"
        what = "; the serve and workers this run started were stopped" if started else ""
        return Stopped(f"stopped by {how}{what}; run it again to continue the study",
                       130 if self.received == signal.SIGINT else 143)


async def _run_kafka(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Kafka mode: submit through the SDK; with --workers N > 0 also run `stagetree serve` and N
    workers for the duration (a one-machine deployment on real Kafka).

    Raises:
        Stopped: SIGTERM or SIGINT (:class:`_StopSignals`) stopped it.
    """
    import asyncio

    with _StopSignals(asyncio.current_task()) as stop:
        try:
            return await _run_kafka_study(args, console, stop)
        except asyncio.CancelledError:
            if stop.received is None:
                raise
            raise stop.stopped(bool(args.workers)) from None


async def _run_kafka_study(args: argparse.Namespace, console: Console, stop: _StopSignals) -> dict[str, Any]:
    """:func:`_run_kafka`'s study: the logs it makes are put in ``stop.logs``."""
    import asyncio
    import subprocess

    from events import tracing
    from events.keys import secret_from
    from stagetree.kafka_runtime import KafkaRuntime
    from stagetree.worker_processes import Spawned, watch

    loaded = _study_file(args.file)
    settings = _settings_of(args.file, loaded[2])
    out = _out_dir(args.out, loaded[4])
    _check_out(out)
    if args.checkpoint_store is None:
        args.checkpoint_store = os.environ.get("STAGETREE_CHECKPOINT_STORE")
    if args.workers and not args.checkpoint_store:
        raise UsageError("--checkpoint-store (or $STAGETREE_CHECKPOINT_STORE) is required to start workers")
    if args.workers:
        _check_device(args.device)
    elif args.checkpoint_budget is not None:
        raise UsageError(f"--checkpoint-budget {args.checkpoint_budget!r} is applied by the serve that `run "
                         "--workers N` starts; with --workers 0 give it to the deployment's `stagetree serve` (or "
                         "$STAGETREE_CHECKPOINT_BUDGET there)")
    mode = "trial" if args.no_merge else "merged"
    port = reserve(args.dashboard) if args.dashboard is not None else None
    if args.workers:  # the serve it starts: refused (exit 2) while an earlier run's still holds the directory
        _check_serve_state(out)
    log = _kafka_log(args, probe=True)
    stop.logs.append(log)
    procs: list[Spawned] = []
    app_id = _run_app_id(args.topic_prefix, loaded[4])
    try:  # two runs at once: the second is refused here
        out_lock = _out_lock(out) if args.workers else None
    except UsageError:
        log.close()
        raise
    runtime = KafkaRuntime(log, study=loaded[4])  # a later client of the study fences this one
    poller = asyncio.create_task(runtime.run())
    dashboard = None
    try:
        if port is not None:
            dashboard = await asyncio.get_running_loop().run_in_executor(
                None, _start_dashboard, f"kafka://{args.bootstrap_servers}/{args.topic_prefix}", port,
                secret_from(args.log_key), console)
        common = ["--bootstrap-servers", args.bootstrap_servers, "--topic-prefix", args.topic_prefix,
                  "--plan-partitions", str(args.plan_partitions), "--otel-exporter", tracing.spec()]
        workers = [f"w{i}" for i in range(args.workers)]

        async def study() -> dict[str, Any]:
            if workers:
                await runtime.ready(workers)
            return await _conduct(runtime, log, args, loaded, settings, mode)

        if workers:
            out.mkdir(parents=True, exist_ok=True)
            # the serve applies the budget (it decides evictions and deletes them from the store)
            budget = [] if args.checkpoint_budget is None else ["--checkpoint-budget", str(args.checkpoint_budget)]
            procs.append(Spawned("serve", functools.partial(
                _spawn, ["serve", *common, "--state-dir", str(out / "serve-state"), "--app-id", app_id,
                         "--checkpoint-store", args.checkpoint_store, *budget])))
            procs += [Spawned(f"worker {w}", functools.partial(
                _spawn, ["worker", *common, "--checkpoint-store", args.checkpoint_store, "--worker-id", w,
                         "--study", str(args.file), "--device", args.device])) for w in workers]
            # the processes it started are watched while the study runs: one that exits is
            # started again, or ends the run (a refusal of its input, its restarts spent)
            warn = functools.partial(_warn, console)
            summary = await _while_watched(study(), watch(procs, warn))
        else:  # a deployment started apart: say so when nothing there can run the study
            hint = asyncio.create_task(_hint_idle_deployment(runtime, args, console))
            try:
                summary = await study()
            finally:
                hint.cancel()
        if procs:  # the serve we started seals the chain: stop it only once the study's end is sealed
            await _sealed(runtime, dict(runtime.last_record), console)
    finally:
        if dashboard is not None:
            dashboard.stop()
        poller.cancel()
        runtime.close()
        # The workers first (each leaves with a WorkerLost of its own), then the serve, whose
        # last seal then covers their goodbyes too.
        for group in ([s.proc for s in procs[1:]], [s.proc for s in procs[:1]]):
            for proc in group:
                proc.terminate()
            for proc in group:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if procs:
            _forget_serve_app(log, app_id, console)
        log.close()
        if out_lock is not None:
            out_lock.close()
    return _write_summary(out, summary)


def _out_lock(out: Path) -> StateDirLock:
    """The lock a ``run --workers N`` on Kafka holds in its ``--out`` while it runs
    (:data:`stagetree.state_lock.RUN_LOCK_FILE`): two such runs started at once on one ``--out``
    both passed :func:`_check_serve_state`, and the second one's serve was refused there.

    Raises:
        UsageError: (exit 2) naming ``--out``: another live run holds it, or it cannot be made.
    """
    from stagetree.state_lock import RUN_LOCK_FILE, StateDirError, StateDirInUse, StateDirLock

    try:
        return StateDirLock(out, RUN_LOCK_FILE, "run")
    except StateDirInUse as exc:
        raise UsageError(f"--out {str(out)!r} is in use by {exc.holder}, a run of this directory that is still "
                         "going; wait for it to end, or choose another --out") from None
    except StateDirError as exc:
        raise UsageError(f"--out: {exc}") from None


def _check_serve_state(out: Path) -> None:
    """Refuse (exit 2) a ``run --workers N`` on Kafka whose ``--out`` holds the state directory
    (``serve-state``) of a serve that is still running: an earlier run's, still going or still
    stopping (the serve this run starts would be refused there)."""
    from stagetree.state_lock import StateDirInUse, check_free

    try:
        check_free(out / "serve-state")
    except StateDirInUse as exc:
        raise UsageError(f"--out {str(out)!r}: the serve state directory {str(exc.state_dir)!r} is in use by "
                         f"{exc.holder}, the serve of an earlier run of this directory that is still going (or still "
                         "stopping); "
                         "wait for it to end, or choose another --out") from None


HINT_AFTER_S = 15.0
"""Seconds ``run --workers 0`` waits before it says that nothing on the deployment can run it."""


async def _hint_idle_deployment(runtime: Any, args: argparse.Namespace, console: Console) -> None:
    """``run --workers 0``: once :data:`HINT_AFTER_S` went by with nothing dispatched, warn that no
    worker has joined the deployment, or that its workers are idle (no serve decides for this
    topic prefix); the run goes on waiting. Each warning is given once."""
    import asyncio

    where = f"on {args.bootstrap_servers} with --topic-prefix {args.topic_prefix!r}"
    said: set[str] = set()
    while len(said) < 2:
        dispatched = len(runtime.state.dispatches)
        await asyncio.sleep(HINT_AFTER_S)
        state = runtime.state
        if len(state.dispatches) != dispatched:
            continue
        if not any(w.alive for w in state.workers.values()):
            if "workers" not in said:
                said.add("workers")
                _warn(console, f"waiting: no worker has joined the deployment {where}; start `stagetree worker` "
                               "there (and `stagetree serve`), or run with --workers N")
        elif state.idle_workers() and "serve" not in said:
            said.add("serve")
            _warn(console, f"waiting: {len(state.idle_workers())} worker(s) {where} are idle and nothing was "
                           f"dispatched in {HINT_AFTER_S:.0f} s; is `stagetree serve` running there?")


def _warn(console: Console, text: str) -> None:
    from rich.markup import escape

    console.print(f"[yellow]warning:[/yellow] {escape(text)}")


async def _while_watched(work: Coroutine[Any, Any, T], watching: Coroutine[Any, Any, None]) -> T:
    """``work``'s result, while ``watching`` runs beside it; when ``watching`` raises first,
    ``work`` is cancelled and its error raised instead."""
    import asyncio
    import contextlib

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watching)
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher.done() and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            watcher.result()  # raises what ended the watch
        return await task
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pending
            elif not pending.cancelled():
                pending.exception()  # seen: what a stop made moot is not logged as never retrieved


def _run_app_id(prefix: str, study: str) -> str:
    """The id of the serve app a run starts (its consumer group, and its faust topics
    ``<id>-*``): ``<prefix>stagetree-<study>-<8 hex digits>``, the study's name made fit for a
    topic name and cut so that the id keeps to the 200 characters of ``--app-id``. Under the
    deployment's topic prefix, as every other topic of the run (a broker whose ACLs grant a
    prefix), unless the prefix leaves no room for it (over 180 characters): then without it."""
    import uuid

    name = re.sub(r"[^A-Za-z0-9._-]", "_", study)
    room = 200 - len("stagetree--") - 8 - len(prefix)
    if room < 1:
        prefix, room = "", 200 - len("stagetree--") - 8
    return f"{prefix}stagetree-{name[:min(100, room)]}-{uuid.uuid4().hex[:8]}"


def _forget_serve_app(log: Any, app_id: str, console: Console) -> None:
    """Delete the faust topics (``<app_id>-*``) of the serve app a run started and stopped: no
    other process joins that app, and each run would otherwise leave one on the cluster. What
    cannot be deleted within 10 s is a warning, never the run's failure (nor a long wait when
    the broker is what failed)."""
    from rich.markup import escape

    from events.log import LogError

    try:
        failures = log.delete_topics(f"{app_id}-", timeout_s=10.0)
    except LogError as exc:
        failures = [str(exc)]
    for failure in failures:
        console.print(f"[yellow]warning:[/yellow] the topics of this run's serve app {app_id!r} were not all "
                      f"deleted: {escape(failure)}")


async def _sealed(runtime: Any, upto: dict[int, int], console: Console, timeout_s: float = 60.0) -> None:
    """Wait until seals cover every partition of the plan stream up to ``upto[partition]`` (the
    study's records as the runtime folded them), as the runtime folds them, so that stopping the
    ``serve`` this command started leaves a stream ``replay verify`` finds sealed to its end;
    after ``timeout_s`` seconds a warning says it is not."""
    import asyncio

    deadline = time.monotonic() + timeout_s
    while runtime.unsealed(upto):
        if time.monotonic() > deadline:
            left = ", ".join(f"partition {p} through offset {o}" for p, o in sorted(runtime.unsealed(upto).items()))
            console.print(f"[yellow]warning:[/yellow] the plan stream was not sealed ({left}) within {timeout_s:g} s; "
                          "`replay verify` will report its last records as not sealed")
            return
        await asyncio.sleep(0.1)


def _print_summary(summary: dict[str, Any], console: Console) -> None:
    from rich.markup import escape

    best = next((t for t in summary["trials"] if t["trial_id"] == summary["best_trial"]), None)
    console.print(f"[bold]{summary['name']}[/bold] ({summary['mode']}, {counted(summary['workers'], 'worker')}): "
                  f"{len(summary['trials'])} trials, best {summary['best_trial']} = {summary['best_metric']}")
    if best is not None:  # at the step its metric was measured (a summary without `best_step`: its final step)
        step = summary.get("best_step")
        console.print(f"  best hp: {best['hp']}  at {best['steps'] if step is None else step} steps")
    rate = summary["merge_rate"]
    console.print(f"  steps: total {summary['total_steps']}, unique {summary['unique_steps']}, "
                  f"executed {summary['executed_steps']}; merge rate p = {rate:.3f}" if rate else "")
    console.print(f"  worker-seconds {summary['worker_seconds']:.1f}, end-to-end {summary['end_to_end_seconds']:.1f} s")
    others = [s for s in summary.get("studies_sharing_plan") or [] if s != summary["name"]]
    if others:
        q = summary.get("k_wise_merge_rate")
        earlier, since = summary.get("steps_from_earlier_studies"), summary.get("executed_steps_since_start")
        console.print(f"  plan shared with {', '.join(others)}: k-wise merge rate q = "
                      + (f"{q:.3f}" if q else "n/a")
                      + (f"; {earlier} steps answered from earlier studies" if earlier is not None else "")
                      + (f", {since} steps trained since this study started" if since is not None else ""))
    console.print(f"  summary: {summary['summary_file']}")
    if summary.get("log_anchor"):
        console.print(f"  log anchor: {summary['log_anchor']} (keep it apart from the run: `stagetree replay verify "
                      "--anchor` then proves the log still holds this study unchanged)", soft_wrap=True)
    failed = [t for t in summary["trials"] if t["status"] == "failed"]
    if failed:
        console.print(f"  [red]{len(failed)} failed[/red] (a failed trial is a loss; see the summary): "
                      + "; ".join(f"{t['trial_id']}: {escape(str(t.get('error')))}" for t in failed))


def _budget_default() -> int | None:
    return _size_from_env("STAGETREE_CHECKPOINT_BUDGET")


def _size_from_env(name: str) -> int | None:
    """The size in bytes that the environment variable ``name`` gives (None when unset or
    empty); UsageError naming the variable and its value when it is not a size."""
    value = os.environ.get(name)
    if not value:
        return None
    try:
        return parse_size(value)
    except argparse.ArgumentTypeError as exc:
        raise UsageError(f"${name} {exc}") from None


def _budget_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint-budget", type=parse_size, default=None, metavar="SIZE",
                   help="bytes of checkpoints to keep at most (500MB, 2GiB, ...; default: "
                        "$STAGETREE_CHECKPOINT_BUDGET, else unbounded); evicted by cost and benefit")


def _int_at_least(minimum: int, what: str):  # type: ignore[no-untyped-def]
    """An argparse type: an int >= ``minimum``, else an error naming the value."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {value!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be a {what} integer, got {value!r}")
        return n

    return parse


_non_negative = _int_at_least(0, "non-negative")
_positive = _int_at_least(1, "positive")


SESSION_TIMEOUT_LIMIT_S = 90.0
"""``serve --session-timeout`` must stay under this (seconds): faust's broker request timeout,
which it refuses a session timeout beyond."""


def _seconds_below(limit: float | None = None):  # type: ignore[no-untyped-def]
    """An argparse type: seconds, a finite number > 0 (and < ``limit``), else an error naming
    the value."""

    def parse(value: str) -> float:
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds > 0 and (limit is None or seconds < limit)):
            bound = f" and < {limit:g}" if limit is not None else ""
            raise argparse.ArgumentTypeError(f"must be seconds > 0{bound}, got {value!r}")
        return seconds

    return parse


def _topic_prefix(value: str) -> str:
    """An argparse type: a topic prefix (empty, or up to 200 characters of a Kafka topic name)."""
    if value and not topics.TOPIC_PART.fullmatch(value):
        raise argparse.ArgumentTypeError(f"must be empty or at most 200 characters of A-Z a-z 0-9 . _ - (it begins "
                                         f"every topic name), got {value!r}")
    return value


def _bootstrap_servers(value: str) -> str:
    """An argparse type: Kafka's ``HOST:PORT[,HOST:PORT...]`` (empty: embedded mode), checked
    here (:func:`events.kafka_log.check_bootstrap_servers`) rather than after librdkafka has
    tried a mistyped address."""
    from events.kafka_log import check_bootstrap_servers

    if not value:
        return value
    try:
        return check_bootstrap_servers(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _nonempty_path(value: str) -> str:
    """An argparse type: a path that is not empty (an empty one meant the working directory)."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"must be a directory path, got {value!r}")
    return value


def _app_id(value: str) -> str:
    """An argparse type: a faust app id (it names the app's Kafka topics and consumer group)."""
    if not topics.TOPIC_PART.fullmatch(value):
        raise argparse.ArgumentTypeError(f"must be 1 to 200 characters of A-Z a-z 0-9 . _ - (it names the serve "
                                         f"app's topics), got {value!r}")
    return value


class _Sub(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommand parsers that all take ``--otel-exporter`` (at any depth)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        parser = super().add_parser(name, **kwargs)
        parser.register("action", "parsers", _Sub)
        parser.add_argument("--otel-exporter", default=None,
                            help="none (default), console, otlp or jsonl:PATH (default: $STAGETREE_OTEL_EXPORTER)")
        return parser


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stagetree", description="Hyper-parameter optimization over stage trees.")
    p.register("action", "parsers", _Sub)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a study file")
    run.add_argument("file", help="Python study file defining `trainer` and `tuner` (optional `seed`, `name`)")
    run.add_argument("--workers", type=_non_negative, default=1,
                     help="worker processes, one per device (default 1); on Kafka, 0 uses a running deployment")
    run.add_argument("--out", help="run directory (default runs/<name>)")
    run.add_argument("--no-merge", action="store_true", help="trial-based baseline: no sharing between trials")
    run.add_argument("--resume", action="store_true", help="continue the run in --out from its log")
    run.add_argument("--device", default="auto", help="auto (cuda:i when present, else cpu), cpu, or cuda:N")
    run.add_argument("--quiet", action="store_true", help="no live progress display")
    run.add_argument("--log-key", help="HMAC secret of the log's hash chain (default: $STAGETREE_LOG_KEY)")
    run.add_argument("--dashboard", nargs="?", type=port_number, const=8080, default=None, metavar="PORT",
                     help="also serve the live dashboard on 127.0.0.1:PORT (default 8080; 0: any free port) "
                          "while the study runs, and print its address")
    _budget_flag(run)
    _kafka_flags(run)
    run.add_argument("--checkpoint-store", default=None,
                     help="s3://BUCKET/PREFIX or a directory, for Kafka-mode workers (default: "
                          "$STAGETREE_CHECKPOINT_STORE); an embedded run keeps its checkpoints in OUT/checkpoints")
    run.set_defaults(func=cmd_run)

    srv = sub.add_parser("serve", help="Kafka mode: the projector and scheduler (a faust app)")
    _kafka_flags(srv, required=True)
    srv.add_argument("--state-dir", type=_nonempty_path, default=os.environ.get("STAGETREE_STATE_DIR", "serve-state"),
                     help="RocksDB projection store (default: $STAGETREE_STATE_DIR or ./serve-state)")
    srv.add_argument("--app-id", type=_app_id, default=os.environ.get("STAGETREE_APP_ID", "stagetree"),
                     help="faust app id (default: $STAGETREE_APP_ID or stagetree)")
    srv.add_argument("--heartbeat-timeout", type=_seconds_below(), default="10",
                     help="seconds of worker silence before it is declared lost (default 10)")
    srv.add_argument("--session-timeout", type=_seconds_below(SESSION_TIMEOUT_LIMIT_S),
                     default=os.environ.get("STAGETREE_SESSION_TIMEOUT", "8"),
                     help="seconds after which the group gives a dead instance's partitions and role to "
                          f"another (default 8, or $STAGETREE_SESSION_TIMEOUT; under {SESSION_TIMEOUT_LIMIT_S:g}, "
                          "faust's request timeout, and within the broker's group.min/max.session.timeout.ms)")
    srv.add_argument("--instance-id", default=os.environ.get("STAGETREE_INSTANCE_ID"),
                     help="this instance's name in its decisions (default: host name and process id)")
    srv.add_argument("--log-key", help="HMAC secret of the plan stream's seals (default: $STAGETREE_LOG_KEY)")
    _budget_flag(srv)
    srv.add_argument("--checkpoint-store", default=os.environ.get("STAGETREE_CHECKPOINT_STORE"),
                     help="s3://BUCKET/PREFIX or a directory: where evicted checkpoints are deleted "
                          "(needed with --checkpoint-budget; default: $STAGETREE_CHECKPOINT_STORE)")
    srv.set_defaults(func=cmd_serve)

    wrk = sub.add_parser("worker", help="Kafka mode: one worker per device")
    _kafka_flags(wrk, required=True)
    wrk.add_argument("--checkpoint-store", default=os.environ.get("STAGETREE_CHECKPOINT_STORE"),
                     help="s3://BUCKET/PREFIX or a directory (default: $STAGETREE_CHECKPOINT_STORE)")
    wrk.add_argument("--checkpoint-cache", default=os.environ.get("STAGETREE_CHECKPOINT_CACHE"), metavar="DIR",
                     help="keep a copy of the checkpoints this node saves or downloads in DIR (shared by the node's "
                          "workers) and load them from it instead of the object store (default: "
                          "$STAGETREE_CHECKPOINT_CACHE; none)")
    wrk.add_argument("--checkpoint-cache-bytes", type=parse_size, default=None, metavar="SIZE",
                     help="bytes of copies the cache holds at most, least recently used evicted first (default: "
                          "$STAGETREE_CHECKPOINT_CACHE_BYTES, else 10GiB)")
    wrk.add_argument("--device", default=os.environ.get("STAGETREE_DEVICE", "auto"), help="auto, cpu or cuda:N")
    wrk.add_argument("--worker-id", default=os.environ.get("STAGETREE_WORKER_ID") or None,
                     help="worker id (default: $STAGETREE_WORKER_ID, else host name and device)")
    wrk.add_argument("--study", help="study file (default: the one its StudyStarted event records)")
    wrk.add_argument("--heartbeat", type=_seconds_below(), default="1", help="seconds between heartbeats (default 1)")
    wrk.set_defaults(func=cmd_worker)
    register(sub, _positive)
    register_simulate(sub, _positive)
    register_export(sub)
    register_dashboard(sub)
    return p


class _BootstrapServersFlag(argparse.Action):
    """``--bootstrap-servers``: its value, and ``bootstrap_servers_from`` set to the flag (the
    value came from the command line, not from ``$STAGETREE_BOOTSTRAP_SERVERS``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.bootstrap_servers_from = "--bootstrap-servers"  # as spelled in full, not abbreviated


def _kafka_flags(p: argparse.ArgumentParser, required: bool = False) -> None:
    servers = os.environ.get("STAGETREE_BOOTSTRAP_SERVERS")
    p.set_defaults(bootstrap_servers_from="$STAGETREE_BOOTSTRAP_SERVERS")
    p.add_argument("--bootstrap-servers", type=_bootstrap_servers, default=servers,  # a string: checked too
                   required=required and not servers, action=_BootstrapServersFlag,
                   help="Kafka HOST:PORT[,HOST:PORT...] (default: $STAGETREE_BOOTSTRAP_SERVERS)"
                        + ("" if required else "; embedded mode when unset"))
    p.add_argument("--topic-prefix", type=_topic_prefix, default=os.environ.get("STAGETREE_TOPIC_PREFIX", ""),
                   help="prefix of every topic name (default: $STAGETREE_TOPIC_PREFIX)")
    p.add_argument("--plan-partitions", type=_positive,  # a string default: checked as the flag's value
                   default=os.environ.get("STAGETREE_PLAN_PARTITIONS", str(topics.DEFAULT_PLAN_PARTITIONS)),
                   help="partitions of stagetree.plan when this command creates it (default "
                        f"{topics.DEFAULT_PLAN_PARTITIONS}, or $STAGETREE_PLAN_PARTITIONS); an existing topic "
                        "keeps its count")


def _kafka_log(args: argparse.Namespace, client_id: str = "stagetree", *, probe: bool = False) -> KafkaLog:
    """A KafkaLog on ``--bootstrap-servers``; with ``probe`` (a command's first contact) the
    cluster must answer first (:meth:`KafkaLog.probe <events.kafka_log.KafkaLog.probe>`, within
    :data:`~events.kafka_log.PROBE_DEADLINE_S` seconds).

    Raises:
        UsageError: (exit 2) nothing answered there: naming ``--bootstrap-servers`` or
            ``$STAGETREE_BOOTSTRAP_SERVERS`` (where the value came from) and the value.
    """
    from events.kafka_log import PROBE_DEADLINE_S, KafkaLog, KafkaLogError, security_from_env

    log = KafkaLog(args.bootstrap_servers, client_id=client_id, topic_prefix=args.topic_prefix,
                   plan_partitions=args.plan_partitions, security=security_from_env())
    if probe:
        try:
            log.probe(PROBE_DEADLINE_S)
        except KafkaLogError as exc:
            log.close()
            flag = getattr(args, "bootstrap_servers_from", "--bootstrap-servers")
            why = exc.error.str() if hasattr(exc.error, "str") else exc.error
            raise UsageError(f"{flag} {args.bootstrap_servers!r}: no Kafka broker answered there within "
                             f"{PROBE_DEADLINE_S:g} s ({why}); check the address, and that Kafka is running "
                             "there") from None
    return log


def cmd_serve(args: argparse.Namespace, console: Console) -> int:
    from events.keys import secret_from
    from gpu_worker.object_store import open_checkpoint_store
    from stagetree.serve import default_instance, serve

    budget = args.checkpoint_budget if args.checkpoint_budget is not None else _budget_default()
    if budget is not None and not args.checkpoint_store:
        raise UsageError("--checkpoint-budget needs --checkpoint-store (or $STAGETREE_CHECKPOINT_STORE): evicted "
                         "checkpoints are deleted there")
    # held until the serve ends, or its process dies: first, so that a second serve on the
    # directory is refused before it contacts anything
    with _state_dir_lock(args.state_dir):
        store = open_checkpoint_store(args.checkpoint_store) if budget is not None else None
        if store is not None:  # it deletes what it evicts there: no PUT asked of its credentials
            _check_store(store, args.checkpoint_store, who="serve instance", write=False)
        instance = args.instance_id or default_instance()
        log = _kafka_log(args, f"stagetree-serve-{instance}", probe=True)
        role_log = _kafka_log(args, f"stagetree-serve-{instance}-role")
        try:
            serve(log, role_log, Path(args.state_dir), app_id=args.app_id, instance=instance,
                  heartbeat_timeout_s=args.heartbeat_timeout, secret=secret_from(args.log_key),
                  session_timeout_s=args.session_timeout, checkpoint_budget=budget, store=store)
        finally:
            log.close()
            role_log.close()
    return 0


def _state_dir_lock(state_dir: str) -> StateDirLock:
    """The lock of serve's ``--state-dir`` (:class:`stagetree.state_lock.StateDirLock`), taken
    before the serve contacts Kafka or opens a store there.

    Raises:
        UsageError: (exit 2) naming ``--state-dir`` and the directory: another live serve
            process holds it (with its pid when it wrote one), or it cannot be made or locked.
    """
    from stagetree.state_lock import StateDirError, StateDirInUse, StateDirLock

    try:
        return StateDirLock(state_dir)
    except StateDirInUse as exc:
        raise UsageError(f"--state-dir {state_dir!r} is in use by {exc.holder}: one serve instance per state "
                         "directory; stop that one first, or give this one its own --state-dir (every serve instance "
                         "needs its own)") from None
    except StateDirError as exc:
        raise UsageError(f"--state-dir: {exc}") from None


def cmd_worker(args: argparse.Namespace, console: Console) -> int:
    import socket

    from events import tracing
    from gpu_worker.checkpoint_cache import cached
    from gpu_worker.kafka_worker import KafkaWorker, TrainingRunner
    from gpu_worker.object_store import open_checkpoint_store

    if not args.checkpoint_store:
        raise UsageError("--checkpoint-store (or $STAGETREE_CHECKPOINT_STORE) is required")
    cache_bytes = args.checkpoint_cache_bytes
    if cache_bytes is None:
        cache_bytes = _size_from_env("STAGETREE_CHECKPOINT_CACHE_BYTES")
    if cache_bytes is not None and not args.checkpoint_cache:
        raise UsageError("--checkpoint-cache-bytes (or $STAGETREE_CHECKPOINT_CACHE_BYTES) needs --checkpoint-cache "
                         "(or $STAGETREE_CHECKPOINT_CACHE)")
    _check_device(args.device)  # "--device is 'x', but ..." (the flag, not the parameter)
    if args.worker_id is not None and not args.worker_id:
        raise UsageError("--worker-id is '', but must be 1 to 200 characters of A-Z a-z 0-9 . _ - (leave it out "
                         "for the host name and device)")
    worker_id = args.worker_id or f"{socket.gethostname()}-{args.device.replace(':', '')}"
    topics.dispatch_stream(worker_id)  # a ValueError naming the id when it cannot name a topic

    def make_log() -> KafkaLog:
        return _kafka_log(args, f"stagetree-worker-{worker_id}")

    tracing.configure(args.otel_exporter, f"stagetree-worker-{worker_id}")
    first = _kafka_log(args, f"stagetree-worker-{worker_id}", probe=True)  # nothing answers there: exit 2
    store = cached(open_checkpoint_store(args.checkpoint_store), args.checkpoint_cache, cache_bytes)
    _check_store(store, args.checkpoint_store)
    runner = TrainingRunner(first, worker_id, store, args.device, study_file=args.study)
    worker = KafkaWorker(make_log, worker_id, runner, heartbeat_s=args.heartbeat)
    signal.signal(signal.SIGTERM, lambda *_: worker.drain())
    worker.run()
    return 0


def _check_store(store: Any, url: str, *, who: str = "worker", write: bool = True) -> None:
    """Check that ``store`` (opened from ``--checkpoint-store`` ``url``) can be used, before a
    ``who`` (a worker, a serve instance) joins the cluster and appends anything to its log: an
    S3 store's bucket exists, takes these credentials and (``write``) a PUT, its endpoint answers
    in time (:meth:`S3CheckpointStore.probe <gpu_worker.object_store.S3CheckpointStore.probe>`,
    each request bounded by ``PROBE_TIMEOUT_S``); a local directory is made if need be and
    (``write``) gets the empty checkpoint written; another store is asked for an object (a
    HEAD). What may pass later (an endpoint that does not answer, a 5xx reply) is tried again
    as a stage's checkpoint read or write is (``STORAGE_ATTEMPTS`` tries, ``STORAGE_BACKOFF_S``
    seconds apart and doubling): a store away for a moment is waited for, a mistyped endpoint
    ends it within a minute.

    Raises:
        UsageError: (exit 2) naming ``--checkpoint-store`` and ``url``, the endpoint
            (``$STAGETREE_S3_ENDPOINT``) or the bucket, and why: credentials the store refuses,
            a bucket that does not exist (a store never creates one), an endpoint still not
            answering after the last try, a directory that cannot be made or written. Each would
            fail every stage the worker ran, its path handed back and dispatched again for ever.
    """
    from gpu_worker.checkpoint import STORAGE_ATTEMPTS, LocalCheckpointStore, StorageError, retry_storage
    from gpu_worker.object_store import CREDENTIAL_CODES, ENV_S3_ENDPOINT, CheckpointStoreError, S3CheckpointStore

    remote = getattr(store, "store", store)  # the store of record behind a node cache

    def check() -> None:
        if isinstance(remote, S3CheckpointStore):
            remote.probe(write=write)
        elif write and isinstance(remote, LocalCheckpointStore):  # the empty checkpoint, as the S3 probe
            remote.put(b"")
        else:
            store.exists("0" * 64)  # an object no checkpoint is

    try:  # refused credentials, a missing bucket and other stores' errors are not tried again
        retry_storage(check, final=lambda exc: not isinstance(exc, CheckpointStoreError)
                      or exc.code in CREDENTIAL_CODES or exc.code == "NoSuchBucket")
    except CheckpointStoreError as exc:
        if exc.code in CREDENTIAL_CODES:
            raise UsageError(f"--checkpoint-store {url!r} refused this {who}'s credentials: {exc}") from None
        if exc.code == "NoSuchBucket":
            raise UsageError(f"--checkpoint-store {url!r}: bucket {exc.bucket!r} does not exist at {exc.endpoint} "
                             f"(a {who} never creates one; check the URL, or create the bucket first)") from None
        raise UsageError(f"--checkpoint-store {url!r}: the object store at {exc.endpoint} "
                         f"(${ENV_S3_ENDPOINT}) cannot be used ({STORAGE_ATTEMPTS} tries): {exc}") from None
    except StorageError as exc:  # a directory that cannot be made or written (a file, a read-only place)
        raise UsageError(f"--checkpoint-store {url!r}: this {who} cannot write checkpoints there: {exc}") from None


def run_embedded(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """``stagetree run`` without Kafka (also :func:`stagetree.run_study`): check the flags,
    start the workers, run the study in ``--out``; returns its summary (as written to
    ``summary.json``). Raises :class:`UsageError` for a bad flag, before anything is created."""
    import asyncio

    from stagetree.worker_processes import PrestartedWorkers, worker_start_method

    if args.workers < 1:
        raise UsageError(f"--workers is {args.workers!r}, but must be >= 1 in embedded mode "
                         "(0 is for Kafka mode with a running deployment)")
    if args.checkpoint_store is not None:  # not $STAGETREE_CHECKPOINT_STORE: a deployment's env is fine here
        raise UsageError(f"--checkpoint-store {args.checkpoint_store!r} is for Kafka mode (with "
                         "--bootstrap-servers); an embedded run keeps its checkpoints in its run directory "
                         "(OUT/checkpoints)")
    # the workers start first: their start-up (importing torch) overlaps checking the
    # arguments, loading the study file and opening the log
    prestarted = PrestartedWorkers(args.workers, worker_start_method(args.device))
    try:
        return asyncio.run(_run_embedded(args, console, prestarted))
    finally:
        prestarted.close()


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    import asyncio

    if args.bootstrap_servers:
        if args.resume or args.log_key:
            raise UsageError("--resume and --log-key are for embedded mode; on Kafka the log is the topics: run the "
                             "study again without --resume to continue it (a study is its name)")
        try:
            summary = asyncio.run(_run_kafka(args, console))
        except KeyboardInterrupt:  # a second signal while the first one's stop was under way
            raise Stopped("stopped at once by a second signal: the serve and workers this run started get SIGTERM "
                          "as it exits; run it again to continue the study", 130) from None
    else:
        try:
            summary = run_embedded(args, console)
        except KeyboardInterrupt:  # Ctrl-C: asyncio cancelled the study (its workers are stopped), then raised it
            raise Stopped("stopped by Ctrl-C (SIGINT): run it again with --resume to continue the study",
                          130) from None
    _print_summary(summary, console)
    failed = [t for t in summary["trials"] if t["status"] == "failed"]
    if failed:
        raise TrialsFailed(f"{len(failed)} trial(s) failed: "
                           + "; ".join(f"{t['trial_id']}: {t.get('error')}" for t in failed))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from rich.console import Console
    from rich.markup import escape

    from events import tracing

    console = Console(soft_wrap=True, emoji=False)
    err = Console(stderr=True, soft_wrap=True, emoji=False)
    try:
        tracing.configure(args.otel_exporter, "stagetree")
        return int(args.func(args, console))
    except (LogError, ValueError) as exc:  # UsageError, StudyFileError, AuditError, ... (exit 2)
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    except Stopped as exc:
        err.print(f"[yellow]{escape(str(exc))}[/yellow]")
        return exc.code
    except (TrialFailed, TrialsFailed, RuntimeError_) as exc:  # the study ran; something failed (exit 1)
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 1
    finally:
        tracing.shutdown()


def console_main() -> None:
    """The ``stagetree`` executable: :func:`main`, then leave without tearing the interpreter
    down. Once ``main`` has returned, everything it recorded is durable (the log closed, spans
    exported); what is left (atexit handlers, non-daemon threads, output buffers) is run here,
    and ``os._exit`` skips freeing every module of a process that has imported torch (1 to 2 s
    on this machine, more than the rest of a short study's exit)."""
    import atexit
    import threading

    dump_stacks_on_sigusr1()
    try:
        code: int | str | None = main()
    except SystemExit as exc:  # argparse: --help, bad arguments (any other error: the interpreter's path)
        code = exc.code
    # what the interpreter's own exit does first (threading._shutdown): the threading atexit
    # hooks, which tell the idle threads of thread pools never shut down (a store's helper
    # pool) to leave, then the join of every non-daemon thread; joining those threads without
    # the hooks waited for ever (a drained worker that did not exit)
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def dump_stacks_on_sigusr1() -> None:
    """In a ``stagetree`` process, ``kill -USR1 <pid>`` prints the stack of every thread to
    stderr and the process goes on: where a serve or a worker waits, for an operator (or a test
    that timed out)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


if __name__ == "__main__":
    dump_stacks_on_sigusr1()
    sys.exit(main())

"""Recomputing a study's tuner decisions from its log (DESIGN.md invariant 3, for tuners).

Every tuner decision is a TunerDecided event recording ``decided_at``, the offset of the last
event its study's runtime had folded (:mod:`events.decisions`). ``replay verify --study FILE``
runs the study file's tuner again, unchanged, over the log: a replay runtime folds the log
only up to the ``decided_at`` of the next recorded decision, resolves the tuner's requests from
that prefix (nothing trains and nothing is appended), lets the tuner run until it waits, and
compares the decisions it takes with the recorded ones, one by one, in order. A decision
recomputed from a prefix that ends at or before the recorded ``decided_at`` is computable from
what the tuner had seen; one the tuner cannot take from that prefix, or takes differently, is a
mismatch named by the recorded decision's offset, its trial, the recorded and the recomputed
decision. Every request the run recorded (TrialSubmitted) must also be one the recomputed tuner
makes: a request no decision causes is named by its offset.

An arrival-order tuner is handed its results in the order the live tuner was (the ``released``
lists of the recorded decisions, an input decided by timing: :class:`stagetree.tuners.ResultInbox`);
a causal-order tuner's order is recomputed by its rule and compared. Each run of a study
(``StudyStarted``: a first run or a ``--resume``) is replayed with a fresh tuner from its own
start. Logs written before decisions were events hold none: their tuner decisions cannot be
recomputed, which the check says.

On a partitioned plan stream (Kafka) a study's runs, decisions and requests are in its plan
key's partition (its ``--no-merge`` trials' requests in their own plans' partitions), offsets
are that partition's, and each decision's ``decided_at_partitions`` says how far every other
partition is folded for it; the study's tuner sees their merged view, as the live SDK did.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from events import topics
from events.codec import InvalidEvent, decode
from events.log import LogError, Record
from events.models import Event, StudyFinished, StudyStarted, TrialSubmitted, TunerDecided
from events.settings import difference
from gpu_worker.loader import StudyFileError
from gpu_worker.trainer import Trainer
from projections.partitions import PartitionedFold
from projections.store import Projector
from replay.anchor import Anchor, check_anchors, source_anchor
from replay.audit import NOT_READ, AuditError, AuditResult, Failure, Source, open_source, verify
from stagetree.runtime import RuntimeBase, settle
from stagetree.study import Study
from stagetree.tuners import Tuner
from stagetree.tuners._base import StudyAnswer
from stagetree.tuners._settings import recorded_settings

NO_DECISIONS = ("not recomputed: the log holds no tuner decisions (its tuner recorded none, e.g. one that calls "
                "submit without decide, or the log was written before decisions were events)")


class _Records:
    """The reading half of the EventLog protocol over records already read from a source (each
    partition's in offset order), so the replay folds with the projector's own fold
    (:class:`Projector`). Appending is refused."""

    def __init__(self, records: Sequence[Record]) -> None:
        self.parts: dict[int, list[Record]] = {}
        for r in records:
            self.parts.setdefault(r.partition, []).append(r)
        self.offsets = {p: [r.offset for r in rs] for p, rs in self.parts.items()}

    def partition_count(self, stream: str) -> int:
        return max(self.parts, default=0) + 1

    def read(self, stream: str, start: int = 0, stop: int | None = None, partition: int = 0) -> Iterator[Record]:
        if stream != topics.PLAN or partition not in self.parts:
            return iter(())
        records, offsets = self.parts[partition], self.offsets[partition]
        end = len(records) if stop is None else bisect_left(offsets, stop)
        return iter(records[bisect_left(offsets, start):end])

    def append(self, stream: str, key: str, value: bytes) -> int:
        raise LogError("a replay of the log appends nothing")

    def append_many(self, stream: str, items: Sequence[tuple[str, bytes]]) -> list[int]:
        raise LogError("a replay of the log appends nothing")

    def end_offset(self, stream: str, partition: int = 0) -> int:
        offsets = self.offsets.get(partition) if stream == topics.PLAN else None
        return offsets[-1] + 1 if offsets else 0

    def close(self) -> None:
        pass


class _ReplayRuntime(RuntimeBase):
    """The Runtime protocol over a prefix of a finished log: :meth:`advance` folds further;
    what the tuner appends (its decisions and requests) is kept, never written. It emits no
    span: its fold is untraced and its study's requests open no ``trial.submit`` span (they are
    never published; the log's events were consumed in the run's own traces).

    A partitioned plan stream (Kafka) is folded partition by partition, and the study sees the
    merged view (:class:`~projections.partitions.PartitionedFold`), as the live SDK did; offsets
    are those of the study's own ``partition``."""

    def __init__(self, records: Sequence[Record], secret: bytes | None, partition: int = 0) -> None:
        log = _Records(records)
        self.partition = partition
        self.parts: PartitionedFold | None = None
        if log.partition_count(topics.PLAN) > 1:
            self.parts = PartitionedFold(log, log.partition_count(topics.PLAN), secret=secret,  # type: ignore[arg-type]
                                         traced=False)
            super().__init__(self.parts)  # type: ignore[arg-type]
        else:
            super().__init__(Projector(log, dead_letters=False, secret=secret, traced=False))  # type: ignore[arg-type]
        self.appended: list[Event] = []
        self._taken = 0

    @property
    def folded(self) -> int:
        """The offset of the last record folded of the study's partition."""
        return self.state.offset if self.parts is None else self.parts.projectors[self.partition].state.offset

    def prefix(self, plan_key: str) -> dict[str, Any]:
        return super().prefix(plan_key) if self.parts is None else self.parts.prefix(self.partition)

    def advance(self, offset: int, partitions: Mapping[int, int] | None = None) -> None:
        """Fold the study's partition up to and including ``offset`` (and every other partition
        up to its offset in ``partitions``, a decision's recorded prefix), and resolve what
        they answer."""
        if self.parts is None:
            self.projector.catch_up(stop=offset + 1)
        else:
            upto = {p: o for p, o in (partitions or {}).items() if p in self.parts.projectors}
            self.parts.catch_up({**upto, self.partition: offset})
        self._notify()

    def append(self, events: list[Event]) -> None:
        self.appended.extend(events)

    def take_decisions(self) -> list[TunerDecided]:
        """The decisions appended since the last call, in order."""
        new, self._taken = self.appended[self._taken:], len(self.appended)
        return [e for e in new if isinstance(e, TunerDecided)]


@dataclass
class Run:
    """One run of a study in the log (its ``StudyStarted`` at ``start``, up to the next one):
    the decisions and the requests recorded in it ``(offset, event)``, and whether it finished."""

    study: StudyStarted
    start: int
    decisions: list[tuple[int, TunerDecided]] = field(default_factory=list)
    requests: list[tuple[int, TrialSubmitted]] = field(default_factory=list)
    finished: int | None = None  # offset of its StudyFinished
    answer: StudyFinished | None = None  # its StudyFinished
    partition: int = 0
    """The plan stream's partition holding the study (its StudyStarted, decisions, StudyFinished,
    and its requests unless they are ``--no-merge`` trials' with plans of their own)."""
    elsewhere: list[tuple[int, TrialSubmitted]] = field(default_factory=list)
    """Requests of the study in other partitions (``--no-merge`` on a partitioned stream; held
    by the study's last run): which run made them is not in their offsets, so they are checked
    against the requests of every run."""


@dataclass
class TunerCheck:
    """The outcome of recomputing one study's decisions: how many matched, the first mismatch
    (None: every recorded decision was recomputed), and notes (a run that ended with its tuner
    still waiting, ...)."""

    study: str
    checked: int = 0
    failure: Failure | None = None
    notes: list[str] = field(default_factory=list)
    made: set[tuple[str, int]] = field(default_factory=set)
    """The requests ``(trial id, steps)`` the recomputed tuner made."""

    @property
    def ok(self) -> bool:
        return self.failure is None


def plan_events(source: Source) -> list[tuple[int, Event]]:
    """The decodable events of the source's plan stream with their offsets (a partitioned
    stream's partitions one after the other, each in offset order)."""
    return [(offset, event) for _, offset, event in _plan_events(source)]


def _plan_events(source: Source) -> list[tuple[int, int, Event]]:
    out = []
    for r in source.streams.get(topics.PLAN, []):
        try:
            out.append((r.partition, r.offset, decode(r.value)))
        except InvalidEvent:
            continue
    return out


def runs_of(events: Sequence[tuple[int, int, Event]]) -> dict[str, list[Run]]:
    """Each study's runs in the log, in order, with their decisions, from ``(partition, offset,
    event)`` triples (each partition's in offset order). A study's runs are in the partition
    of its first StudyStarted."""
    home: dict[str, int] = {}
    for partition, _, event in events:
        if isinstance(event, StudyStarted):
            home.setdefault(event.study_id, partition)
    runs: dict[str, list[Run]] = {}
    elsewhere: dict[str, list[tuple[int, TrialSubmitted]]] = {}
    for partition, offset, event in events:
        study_id = getattr(event, "study_id", None)
        if study_id not in home:
            continue
        if partition != home[study_id]:
            if isinstance(event, TrialSubmitted):
                elsewhere.setdefault(study_id, []).append((offset, event))
            continue
        if isinstance(event, StudyStarted):
            runs.setdefault(event.study_id, []).append(Run(event, offset, partition=partition))
        elif isinstance(event, TunerDecided) and runs.get(event.study_id):
            runs[event.study_id][-1].decisions.append((offset, event))
        elif isinstance(event, TrialSubmitted) and runs.get(event.study_id):
            runs[event.study_id][-1].requests.append((offset, event))
        elif isinstance(event, StudyFinished) and runs.get(event.study_id):
            runs[event.study_id][-1].finished, runs[event.study_id][-1].answer = offset, event
    for study_id, requests in elsewhere.items():
        runs[study_id][-1].elsewhere = requests
    return runs


def _differs(recorded: TunerDecided, again: TunerDecided) -> list[str]:
    a = recorded.model_dump(mode="json", include={"tuner", "decision", "released"})
    b = again.model_dump(mode="json", include={"tuner", "decision", "released"})
    out = [k for k in ("tuner", "released") if a[k] != b[k]]
    return out + [f"decision.{k}" for k in sorted(set(a["decision"]) | set(b["decision"]))
                  if a["decision"].get(k) != b["decision"].get(k)]


def _said(event: TunerDecided) -> str:
    return event.decision.describe(event.tuner)


def replay_run(records: Sequence[Record], run: Run, tuner: Tuner, trainer: Trainer, *,
               secret: bytes | None = None) -> TunerCheck:
    """Recompute the decisions of one run of a study (see the module docstring) with ``tuner``
    (a fresh one, as the study file defines it) and ``trainer``."""
    study_id = run.study.study_id
    check = TunerCheck(study_id)
    runtime = _ReplayRuntime(records, secret, run.partition)
    study = Study(runtime, study_id, trainer, run.study.seed, merge=run.study.mode == "merged")  # type: ignore[arg-type]
    if study.plan_key != run.study.plan_key:
        check.failure = Failure("tuner", run.start, run.study.type, f"study {study_id!r}: the study file's trainer and "
                                f"seed give plan key {study.plan_key}, but the log's run has {run.study.plan_key} "
                                "(another trainer, version or seed): its decisions cannot be recomputed with it")
        return check
    study.replaying = True
    study.writes_tuner_state = False
    study.release_script = deque((r.trial_id, r.steps) for _, e in run.decisions for r in e.released)
    recorded = run.decisions

    def misplaced(j: int) -> Failure | None:
        """The j-th recorded decision's prefix does not end between its run's start and itself."""
        offset, event = recorded[j]
        if run.start <= event.decided_at < offset:
            return None
        return Failure("tuner", offset, event.type, f"trial {event.decision.trial_id}: decided at offset "
                       f"{event.decided_at}, which is not between its run's StudyStarted (offset {run.start}) "
                       "and itself")

    async def drive() -> None:
        runtime.advance(run.start)
        task = asyncio.ensure_future(tuner.run(study))
        try:
            while True:
                await settle()
                for again in runtime.take_decisions():
                    if check.checked == len(recorded):
                        last = recorded[-1][0] if recorded else run.start
                        check.failure = Failure("tuner", last, "TunerDecided", (
                            f"the tuner recomputed from the log decides more than the log holds: after the last "
                            f"recorded decision of study {study_id!r} (offset {last}) it computes {_said(again)} "
                            f"(trial {again.decision.trial_id}) from the prefix up to offset {again.decided_at}"))
                        return
                    offset, event = recorded[check.checked]
                    check.failure = misplaced(check.checked)
                    if check.failure is not None:
                        return
                    differs = _differs(event, again)
                    if differs:
                        check.failure = Failure("tuner", offset, event.type, (
                            f"trial {event.decision.trial_id}: recorded {_said(event)}; the tuner computes "
                            f"{_said(again)} from the prefix up to offset {again.decided_at} (they differ in "
                            f"{', '.join(differs)})"))
                        return
                    check.checked += 1
                if task.done():
                    error = None if task.cancelled() else task.exception()
                    if error is not None:
                        where = recorded[check.checked][0] if check.checked < len(recorded) else run.start
                        check.failure = Failure("tuner", where, None, f"the tuner of study {study_id!r} raised "
                                                                      f"{type(error).__name__}: {error}")
                    elif check.checked < len(recorded):
                        offset, event = recorded[check.checked]
                        check.failure = Failure("tuner", offset, event.type, (
                            f"trial {event.decision.trial_id}: recorded {_said(event)}; the tuner recomputed from "
                            "the log had already finished"))
                    elif run.answer is not None and run.finished is not None and not task.cancelled():
                        check.failure = _wrong_answer(run.finished, run.answer, task.result().answer)
                    return
                if check.checked == len(recorded):
                    if run.finished is not None:
                        check.failure = Failure("tuner", run.finished, "StudyFinished", (
                            f"study {study_id!r} finished here, but the tuner recomputed from the log does not finish "
                            f"after its last recorded decision: it waits for results"))
                    else:
                        check.notes.append(f"study {study_id!r}: the run at offset {run.start} has not finished (it "
                                           "was stopped, or is still running) with its tuner waiting for results")
                    return
                offset, event = recorded[check.checked]
                check.failure = misplaced(check.checked)
                if check.failure is not None:
                    return
                if event.decided_at <= runtime.folded:
                    check.failure = Failure("tuner", offset, event.type, (
                        f"trial {event.decision.trial_id}: recorded {_said(event)}, decided at offset "
                        f"{event.decided_at}; the tuner computes nothing from the prefix up to offset "
                        f"{runtime.folded}"))
                    return
                runtime.advance(event.decided_at, event.decided_at_partitions)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(drive())
    check.made = {(e.trial_id, e.steps) for e in runtime.appended if isinstance(e, TrialSubmitted)}
    if check.failure is None:  # every request of the run is one the tuner makes
        check.failure = _unmade(run.requests, check.made)
    return check


def _wrong_answer(offset: int, recorded: StudyFinished, again: StudyAnswer) -> Failure | None:
    """A failure when the StudyFinished at ``offset`` records another answer than the tuner's
    recomputed one (its best trial, best metric, and best step where the log has one: logs
    written before the field have none), else None."""
    said = (recorded.best_trial, recorded.best_metric, recorded.best_step)
    computed = (again.best_trial, again.best_metric, again.best_step if recorded.best_step is not None else None)
    if said == computed:
        return None
    names = ("best_trial", "best_metric", "best_step")
    return Failure("tuner", offset, recorded.type, (
        f"study {recorded.study_id!r} finished recording " + ", ".join(f"{n} {v!r}" for n, v in zip(names, said))
        + "; the tuner recomputed from the log answers " + ", ".join(f"{n} {v!r}" for n, v in zip(names, computed))))


def _unmade(requests: Sequence[tuple[int, TrialSubmitted]], made: set[tuple[str, int]]) -> Failure | None:
    """The first of ``requests`` that no recomputed decision makes, as a failure."""
    for offset, event in requests:
        if (event.trial_id, event.steps) not in made:
            return Failure("tuner", offset, event.type, (
                f"trial {event.trial_id}: a request for {event.steps} steps that no decision of the tuner "
                "recomputed from the log makes"))
    return None


def _check_runs(records: Sequence[Record], study: str, runs: Sequence[Run],
                make: Callable[[int], tuple[Tuner, Trainer]], secret: bytes | None) -> TunerCheck:
    """Recompute every run of ``study`` in order (``make(i)``: a fresh tuner and the trainer for
    run ``i``), stopping at the first mismatch; then the study's requests in other partitions
    must be ones some run made."""
    total = TunerCheck(study)
    for i, run in enumerate(runs):
        tuner, trainer = make(i)
        recorded = run.study.tuner_settings
        try:
            why = None if recorded is None else difference(recorded, recorded_settings(tuner))
        except ValueError as exc:  # settings that cannot be recorded: not the ones the run recorded
            why = str(exc)
        if why is not None:  # another tuner, other arguments or another space: not the run's study file
            total.failure = Failure("tuner", run.start, run.study.type, (
                f"study {study!r}: the run that starts here recorded other tuner settings than the study file's "
                f"tuner has ({why}); its decisions were not recomputed: pass --study with the study file the run "
                "used"))
            return total
        check = replay_run(records, run, tuner, trainer, secret=secret)
        total.checked += check.checked
        total.notes += check.notes
        total.made |= check.made
        if check.failure is not None:
            total.failure = check.failure
            return total
    total.failure = _unmade([r for run in runs for r in run.elsewhere], total.made)
    return total


def check_study(source: str | Path | Source, study: str, make: Callable[[], Tuner], trainer: Trainer, *,
                secret: bytes | None = None) -> TunerCheck:
    """Recompute every decision of ``study`` in ``source`` (a run directory, a JSONL export,
    kafka://... or an opened :class:`Source`), each run of it with a fresh tuner from ``make``.

    Raises:
        AuditError: the source cannot be read, or the study is not in it.
    """
    opened = source if isinstance(source, Source) else open_source(str(source), secret=secret)
    records = opened.streams.get(topics.PLAN, [])
    runs = runs_of(_plan_events(opened)).get(study)
    if not runs:
        raise AuditError(f"study {study!r} is not in {str(opened.path)!r}")
    if not any(run.decisions for run in runs):
        return TunerCheck(study, notes=[f"study {study!r}: {NO_DECISIONS}"])
    return _check_runs(records, study, runs, lambda _: (make(), trainer), secret)


def _study_specs(path: str) -> dict[str, tuple[Tuner, Trainer]]:
    """The studies a study file defines: name -> (a fresh tuner, its trainer)."""
    from stagetree.simulate_cli import load_simulation

    trainer, studies, _ = load_simulation(path)
    return {s.name: (s.tuner, trainer) for s in studies}


def verify_decisions(source: Source, study_file: str | None = None, *,
                     secret: bytes | None = None) -> tuple[Failure | None, str, bool]:
    """The ``tuner`` check of ``replay verify``: recompute every study's decisions with the
    tuner of ``study_file`` (default: the file each study's StudyStarted records). Returns the
    first mismatch (None when every recomputed decision matched), what was checked, with a
    note for what was not (no decisions in the log, no study file), and whether the check was
    skipped: the log holds tuner decisions and none could be recomputed.

    Raises:
        AuditError: ``study_file`` was given but cannot be loaded, or defines none of the
            studies whose decisions the log holds.
    """
    events = _plan_events(source)
    runs = runs_of(events)
    if not runs:  # an empty log, or one that holds only an Optuna study's journal
        return None, "not recomputed: the log holds no study", False
    if not any(isinstance(e, TunerDecided) for _, _, e in events):
        return None, NO_DECISIONS, False
    records = source.streams.get(topics.PLAN, [])
    if study_file is not None:
        try:
            defined = _study_specs(study_file)
        except StudyFileError as exc:
            raise AuditError(f"--study: {exc}") from None
        decided = sorted(study_id for study_id in runs if any(run.decisions for run in runs[study_id]))
        if not set(defined) & set(decided):
            raise AuditError(f"--study {study_file!r} defines no study whose decisions the log holds (it defines "
                             f"{', '.join(map(repr, sorted(defined))) or 'none'}; the log's: "
                             f"{', '.join(map(repr, decided))})")
    checked, studies, notes = 0, 0, []
    for study_id in sorted(runs):
        if not any(run.decisions for run in runs[study_id]):
            notes.append(f"study {study_id!r}: {NO_DECISIONS}")
            continue
        path = study_file or runs[study_id][-1].study.study_file
        if not path or not Path(path).is_file():
            notes.append(f"study {study_id!r}: tuner decisions not recomputed: no study file (the log names "
                         f"{path!r}; pass --study FILE)")
            continue

        def make(path: str = path, study_id: str = study_id) -> tuple[Tuner, Trainer] | None:
            try:
                return _study_specs(path).get(study_id)
            except StudyFileError:
                return None

        spec = make()
        if spec is None:
            notes.append(f"study {study_id!r}: tuner decisions not recomputed: {path!r} defines no study of that "
                         "name or does not load")
            continue
        studies += 1
        check = _check_runs(records, study_id, runs[study_id],
                            lambda i, spec=spec, make=make: spec if i == 0 else (make() or spec), secret)
        checked += check.checked
        notes += check.notes
        if check.failure is not None:
            return check.failure, "", False
    detail = f"{checked} tuner decisions of {studies} {'study' if studies == 1 else 'studies'} recomputed from their " \
             "log prefixes" if studies else "tuner decisions not recomputed"
    return None, "; ".join([detail, *notes]), studies == 0


def later_checks(anchors: Sequence[Anchor] = ()) -> tuple[str, ...]:
    """The checks :func:`verify_all` makes after those of :func:`replay.audit.verify`, in order."""
    return ("tuner", "anchor") if anchors else ("tuner",)


def verify_all(source: Source, secret: bytes | None = None, progress: Callable[[int], None] | None = None,
               study_file: str | None = None, anchors: Sequence[Anchor] = ()) -> AuditResult:
    """``stagetree replay verify``: every check of :func:`replay.audit.verify`, then the
    ``tuner`` check (:func:`verify_decisions`), then, when ``anchors`` are given, the ``anchor``
    check (:func:`replay.anchor.check_anchors`); when every check passed, ``anchor`` is the plan
    stream's (:func:`replay.anchor.source_anchor`). Never raises for a mismatch.

    Raises:
        AuditError: ``study_file`` was given but cannot be loaded; ``anchors`` were given for a
            deployment's topics.
    """
    result = verify(source, secret, progress)
    if result.damaged:  # the log cannot be read: the chain check names the damage
        for name in later_checks(anchors):
            result.add(name, None, NOT_READ, skipped=True)
        return result
    failure, detail, skipped = verify_decisions(source, study_file, secret=secret)
    result.add("tuner", failure, detail, skipped=skipped)
    if anchors:
        result.add("anchor", check_anchors(source, anchors),
                   f"the log holds the anchored {'record' if len(anchors) == 1 else 'records'} "
                   f"({', '.join(f'{a.stream}@{a.offset}' for a in anchors)}) with their anchored chain")
    anchor = source_anchor(source) if result.ok else None
    result.anchor = None if anchor is None else str(anchor)
    return result


__all__ = ["NO_DECISIONS", "Run", "TunerCheck", "check_study", "later_checks", "plan_events", "replay_run",
           "runs_of", "verify_all", "verify_decisions"]

"""Multi-study merging (Hippo §7, thesis §4.2.2): a later study in the same run directory shares
the search plan of an earlier one with the same plan key and is answered from its steps.

The fast tests fold a hand-built two-study log with the real reducer and scheduler
(``scheduler.simulation.Simulation``, instant workers) and check the sharing keys of
``summary.json`` against values worked out by hand. The end-to-end test runs the digits CNN of
``tests/studies/tiny_sha.py`` ("tiny") and then ``tiny_sha_b.py`` ("tiny-b": same trainer and
seed, an overlapping space) in one ``--out`` directory through the ``stagetree`` command.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from events import topics
from events.codec import decode
from events.hp import Constant, Piecewise, config_from_json, first_divergence
from events.log import EmbeddedLog, append_events, event_key
from events.models import (
    COORDINATOR_RESTARTED,
    StageDispatched,
    StageFinished,
    StudyFinished,
    StudyStarted,
    TrialSubmitted,
    WorkerJoined,
    WorkerLost,
)
from projections.search_plan import merged_unique_steps
from projections.summary import build_summary, elapsed, k_wise_merge_rate, last_started, sharing_steps, summary_path
from scheduler.simulation import Simulation
from stagetree import cli

STUDIES = Path(__file__).parent / "studies"
STAGETREE = [sys.executable, "-m", "stagetree.cli"]

# ----------------------------------------------------------------------------- hand-built log

LR_01 = {"lr": Constant(0.1)}
LR_01_THEN_005 = {"lr": Piecewise(functions=(Constant(0.1), Constant(0.05)), boundaries=(10,))}
LR_02 = {"lr": Constant(0.2)}


def _start(sim: Simulation, study: str, plan_key: str = "plan", mode: str = "merged", ts: float = 0.0) -> None:
    sim.emit(StudyStarted(study_id=study, name=study, plan_key=plan_key, mode=mode, workers=2, seed=0,
                          trainer="sim@1", ts=ts))


def _submit(sim: Simulation, study: str, trial: str, hp: dict, steps: int, plan_key: str = "plan") -> None:
    sim.emit(TrialSubmitted(study_id=study, trial_id=trial, plan_key=plan_key, seed=0, hp=hp, steps=steps))


def _summary(sim: Simulation, study: str) -> dict:
    return build_summary(sim.state, study, mode="merged", workers=2, best_trial=None, best_metric=None,
                         end_to_end_seconds=0.0, events=sim.events)


def test_the_hand_built_configs_share_exactly_the_first_10_steps() -> None:
    assert first_divergence(LR_01, LR_01_THEN_005, 0, 30) == 10
    assert first_divergence(LR_01, LR_02, 0, 30) == 0


@pytest.fixture
def two_studies() -> Simulation:
    """Study "a" trains lr 0.1 to 30 and (0.1, then 0.05 from step 10) to 20: a root [0, 30) and a
    child [10, 20), 40 unique steps of 50 asked. Then study "b" asks lr 0.1 to 40 (root [30, 40)
    is new), the same second config to 20 (all trained) and lr 0.2 to 10 (a new root [0, 10))."""
    sim = Simulation(workers=2)
    _start(sim, "a")
    _submit(sim, "a", "a1", LR_01, 30)
    _submit(sim, "a", "a2", LR_01_THEN_005, 20)
    sim.run()
    sim.emit(StudyFinished(study_id="a", best_trial="a1", best_metric=1.0, end_to_end_seconds=1.0))
    _start(sim, "b")
    _submit(sim, "b", "b1", LR_01, 40)
    _submit(sim, "b", "b2", LR_01_THEN_005, 20)
    _submit(sim, "b", "b3", LR_02, 10)
    sim.run()
    return sim


def test_a_later_study_counts_what_earlier_studies_trained(two_studies: Simulation) -> None:
    b = _summary(two_studies, "b")
    assert [t["trial_id"] for t in b["trials"]] == ["b1", "b2", "b3"]  # only its own trials
    assert b["studies_sharing_plan"] == ["a", "b"]
    assert (b["total_steps"], b["unique_steps"]) == (70, 60)  # root [0, 40) + child [10, 20) + root [0, 10)
    assert b["steps_from_earlier_studies"] == 40  # root [0, 30) and child [10, 20), trained by "a"
    assert b["executed_steps_since_start"] == 20  # root [30, 40) and the new root [0, 10)
    assert b["executed_steps"] == 60  # the shared plan's steps: both studies'
    assert b["k_wise_merge_rate"] == pytest.approx((50 + 70) / 60)
    # the same numbers from the trials alone: overlap = unique(A) + unique(B) - unique(A u B)
    a_trials, b_trials = [(LR_01, 30), (LR_01_THEN_005, 20)], [(LR_01, 40), (LR_01_THEN_005, 20), (LR_02, 10)]
    union = merged_unique_steps(a_trials + b_trials)
    assert b["steps_from_earlier_studies"] == merged_unique_steps(a_trials) + b["unique_steps"] - union
    assert b["executed_steps_since_start"] == union - merged_unique_steps(a_trials)
    # every metric "b" shares with "a" at equal steps is the stored one
    trials = two_studies.state.trials
    assert trials["b2"].results[20] == trials["a2"].results[20]
    assert trials["b1"].results[40] == {"step": 40.0}


def test_the_first_study_shares_with_the_later_one_but_got_nothing_from_it(two_studies: Simulation) -> None:
    a = _summary(two_studies, "a")
    assert a["studies_sharing_plan"] == ["a", "b"]
    assert a["steps_from_earlier_studies"] == 0
    assert a["executed_steps_since_start"] == 60  # everything on the plan after its start, "b"'s too
    assert a["k_wise_merge_rate"] == pytest.approx((50 + 70) / 60)
    assert a["merge_rate"] == pytest.approx(50 / 40)


def test_idle_worker_seconds_subtract_only_what_stages_held_while_the_study_ran(two_studies: Simulation,
                                                                               tmp_path: Path) -> None:
    """A later study on a shared plan subtracted the plan's worker-seconds, the earlier study's
    included, from its own capacity (workers x its end-to-end seconds): its idle worker-seconds
    clamped to 0 (and an earlier study's, computed from the log, lost what a later one held).
    They subtract the seconds stages held on the study's plans from its StudyStarted to its
    StudyFinished, in the summary and on the dashboard alike. An instant worker's step is one
    second: "a" held 40 (root [0, 30), child [10, 20)), "b" 20 (root [30, 40), root [0, 10))."""
    from stagetree.dashboard import LiveProjection, open_dashboard_source, study_view

    sim = two_studies
    sim.emit(StudyFinished(study_id="b", best_trial="b1", best_metric=1.0, end_to_end_seconds=15.0))

    def summary(study: str, e2e: float, events: list | None = sim.events) -> dict:
        return build_summary(sim.state, study, mode="merged", workers=2, best_trial=None, best_metric=None,
                             end_to_end_seconds=e2e, events=events)

    a, b = summary("a", 30.0), summary("b", 15.0)
    assert a["worker_seconds"] == b["worker_seconds"] == 60.0  # the shared plan's, both studies'
    assert a["idle_worker_seconds"] == 2 * 30.0 - 40.0  # "b"'s 20 seconds came after "a" finished
    assert b["idle_worker_seconds"] == 2 * 15.0 - 20.0  # "a"'s 40 seconds came before "b" started
    assert summary("b", 15.0, None)["idle_worker_seconds"] == 0.0  # without the log: the plan's seconds

    with EmbeddedLog(tmp_path / "run" / "log") as log:
        append_events(log, topics.PLAN, [(event_key(e), e) for e in sim.events])
    source = open_dashboard_source(str(tmp_path / "run"))
    try:
        projection = LiveProjection()
        projection.fold(source.poll())
        figures = study_view(projection, "b", source.label)["figures"]
    finally:
        source.close()
    assert figures["idle_worker_seconds"] == pytest.approx(b["idle_worker_seconds"]) == 10.0
    assert figures["worker_seconds"] == pytest.approx(60.0)


def test_a_study_alone_has_q_equal_to_p_and_no_earlier_steps() -> None:
    sim = Simulation(workers=1)
    _start(sim, "solo")
    _submit(sim, "solo", "s1", LR_01, 30)
    _submit(sim, "solo", "s2", LR_01_THEN_005, 20)
    sim.run()
    s = _summary(sim, "solo")
    assert s["studies_sharing_plan"] == ["solo"]
    assert s["k_wise_merge_rate"] == s["merge_rate"] == pytest.approx(50 / 40)
    assert (s["steps_from_earlier_studies"], s["executed_steps_since_start"]) == (0, 40)
    without_log = build_summary(sim.state, "solo", mode="merged", workers=1, best_trial=None, best_metric=None,
                                end_to_end_seconds=0.0)
    assert without_log["steps_from_earlier_studies"] is None and without_log["executed_steps_since_start"] is None


def test_a_trial_mode_study_is_listed_on_the_base_key_but_shares_no_step(two_studies: Simulation) -> None:
    sim = two_studies
    _start(sim, "c", mode="trial")
    _submit(sim, "c", "c1", LR_01, 30, plan_key="plan/trial/c1")
    sim.run()
    c = _summary(sim, "c")
    assert c["studies_sharing_plan"] == ["a", "b", "c"]
    assert c["steps_from_earlier_studies"] == 0  # its own plan: nothing trained there before
    assert c["executed_steps_since_start"] == 30  # retrained from scratch
    assert c["k_wise_merge_rate"] == pytest.approx((50 + 70 + 30) / 60)
    assert _summary(sim, "b")["studies_sharing_plan"] == ["a", "b", "c"]


def test_steps_trained_twice_before_the_start_count_once(two_studies: Simulation) -> None:
    """A range finished twice (a lost checkpoint retrained) is a union, not a sum."""
    events = list(two_studies.events)
    at = next(i for i, e in enumerate(events) if isinstance(e, StudyStarted) and e.study_id == "b")
    first = next(e for e in events[:at] if isinstance(e, StageFinished))
    again = first.model_copy(update={"from_step": max(0, first.from_step - 5)})
    earlier, since = sharing_steps(two_studies.state, events[:at] + [again] + events[at:], "b")
    assert (earlier, since) == (40, 20)


def test_elapsed_of_a_study_stops_at_its_finish_or_at_its_own_last_event() -> None:
    def started(study: str, ts: float) -> StudyStarted:
        return StudyStarted(study_id=study, name=study, plan_key="plan", mode="merged", workers=1, seed=0,
                            trainer="sim@1", ts=ts)

    def finished(study: str, ts: float) -> StudyFinished:
        return StudyFinished(study_id=study, best_trial=None, best_metric=None, end_to_end_seconds=0.0, ts=ts)

    events = [started("a", 100.0), finished("a", 110.0), started("b", 200.0), finished("b", 203.0)]
    assert elapsed(events, "a") == 10.0 and elapsed(events, "b") == 3.0
    last = TrialSubmitted(study_id="a", trial_id="a1", plan_key="plan", seed=0, hp=LR_01, steps=10, ts=104.0)
    killed = [started("a", 100.0), last, started("b", 200.0), finished("b", 203.0),
              started("a", 300.0), finished("a", 302.0)]
    assert elapsed(killed, "a") == 4.0 + 2.0  # killed at its last event, then resumed after "b"
    # killed, then resumed 30 s later: the resumed run's coordinator declares the dead run's
    # workers lost, its own join and work starts before its StudyStarted; the wait is no one's
    joined = WorkerJoined(worker_id="w0", device="cpu", ts=341.0)
    resumed = [started("a", 300.0), last.model_copy(update={"ts": 304.0}),
               WorkerLost(producer="coordinator", worker_id="w0", reason=COORDINATOR_RESTARTED, ts=334.0),
               joined, started("a", 345.0), finished("a", 347.0)]
    assert elapsed(resumed, "a") == 4.0 + 2.0
    other = WorkerLost(producer="coordinator", worker_id="w0", reason="process 7 was killed", ts=306.0)
    assert elapsed([started("a", 300.0), other, finished("a", 309.0)], "a") == 9.0  # a loss within the run
    # on a deployment, studies run side by side: "b" started 5 ms after "a" ended nothing of "a"
    # (its killed client's incarnation counted 0.005 s); it ends at its own last decision
    beside = [started("a", 100.0), started("b", 100.005), last.model_copy(update={"ts": 116.0}),
              finished("b", 130.0), started("a", 200.0), finished("a", 210.0)]
    assert elapsed(beside, "a") == 16.0 + 10.0 and elapsed(beside, "b") == pytest.approx(29.995)


def test_the_study_started_last_is_found_by_time_not_by_reading_order() -> None:
    """A Kafka plan topic's partitions are read one after another: the last StudyStarted read
    may be an early study on a later partition (the trackers' export and the dashboard open on
    the study started last)."""
    def started(study: str, ts: float) -> StudyStarted:
        return StudyStarted(study_id=study, name=study, plan_key=f"plan-{study}", mode="merged", workers=1, seed=0,
                            trainer="sim@1", ts=ts)

    assert last_started([started("late", 200.0), started("early", 100.0)]) == "late"  # partition 0, then 1
    assert last_started([started("a", 100.0), started("b", 100.0)]) == "b"  # one time: the order read
    assert last_started([]) is None


def test_k_wise_merge_rate_rejects_a_single_string(two_studies: Simulation) -> None:
    with pytest.raises(ValueError, match="study_ids"):
        k_wise_merge_rate(two_studies.state, "ab")


# ----------------------------------------------------------------------------- the run directory


def _log_with_study(out: Path, study: str) -> int:
    with EmbeddedLog(out / "log") as log:
        append_events(log, topics.PLAN, [(study, StudyStarted(study_id=study, name=study, plan_key="p", mode="merged",
                                                              workers=1, seed=7, trainer="digits@1"))])
        return log.end_offset(topics.PLAN)


def test_the_same_study_again_without_resume_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    n = _log_with_study(out, "tiny")  # the name tiny_sha.py declares
    assert cli.main(["run", str(STUDIES / "tiny_sha.py"), "--out", str(out), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'tiny'" in err and "--resume" in err and "--out" in err
    with EmbeddedLog(out / "log", read_only=True) as log:
        assert log.end_offset(topics.PLAN) == n and log.end_offset(topics.DEADLETTER) == 0
    assert sorted(p.name for p in out.iterdir()) == ["log"]  # no workers, no projection store


# ----------------------------------------------------------------------------- end to end


def _run(study: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*STAGETREE, "run", str(STUDIES / study), "--workers", "2", "--out", str(out), "--quiet",
                           *flags], capture_output=True, text=True, timeout=600)


def _summary_of(study: str, out: Path, name: str) -> dict:
    proc = _run(study, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return orjson.loads(summary_path(out, name).read_bytes())  # one summary per study


def _hp_steps(summary: dict) -> list[tuple[dict, int]]:
    return [(config_from_json(t["hp"]), t["steps"]) for t in summary["trials"]]


def _plan_events(out: Path) -> list:
    log = EmbeddedLog(out / "log")
    try:
        return [decode(r.value) for r in log.read(topics.PLAN)]
    finally:
        log.close()


@pytest.mark.e2e
def test_a_later_study_in_the_same_run_directory_trains_only_what_the_first_did_not(tmp_path: Path) -> None:
    out = tmp_path / "shared"
    a = _summary_of("tiny_sha.py", out, "tiny")
    b = _summary_of("tiny_sha_b.py", out, "tiny-b")
    # The directory's summary.json stays the first study's: a later study never overwrites it.
    assert orjson.loads((out / "summary.json").read_bytes())["name"] == "tiny"
    assert (a["name"], b["name"]) == ("tiny", "tiny-b")
    events = _plan_events(out)
    keys = {e.study_id: e.plan_key for e in events if isinstance(e, StudyStarted)}
    assert keys["tiny"] == keys["tiny-b"]
    assert {e.plan_key for e in events if isinstance(e, (TrialSubmitted, StageDispatched))} == {keys["tiny"]}

    assert a["studies_sharing_plan"] == ["tiny"] and a["steps_from_earlier_studies"] == 0
    assert b["studies_sharing_plan"] == ["tiny", "tiny-b"]
    assert len(b["trials"]) == 6  # only its own trials, though "tiny"'s are on the same plan

    unique_a, unique_b = merged_unique_steps(_hp_steps(a)), merged_unique_steps(_hp_steps(b))
    union = merged_unique_steps(_hp_steps(a) + _hp_steps(b))
    assert (unique_a, unique_b) == (a["unique_steps"], b["unique_steps"])
    assert a["executed_steps"] == unique_a  # "tiny" trained every unique step once, before "tiny-b"
    overlap = unique_a + unique_b - union
    assert b["steps_from_earlier_studies"] == overlap > 0
    assert b["executed_steps_since_start"] == union - unique_a  # only what "tiny" had not trained
    assert b["executed_steps"] == union  # the shared plan's steps, both studies'
    assert b["k_wise_merge_rate"] == pytest.approx((a["total_steps"] + b["total_steps"]) / union)

    # configurations both studies asked at equal steps have the same metrics (the stored ones)
    in_a = {(orjson.dumps(t["hp"], option=orjson.OPT_SORT_KEYS), t["steps"]): t["metrics"] for t in a["trials"]}
    shared = [(t, in_a[(orjson.dumps(t["hp"], option=orjson.OPT_SORT_KEYS), t["steps"])]) for t in b["trials"]
              if (orjson.dumps(t["hp"], option=orjson.OPT_SORT_KEYS), t["steps"]) in in_a]
    assert shared, "no configuration of tiny-b was asked at the same steps as in tiny"
    for t, metrics in shared:
        assert t["metrics"] == metrics, t["hp"]
    # ... and every step of "tiny-b" under a node "tiny" had trained was answered, not retrained
    at = next(i for i, e in enumerate(events) if isinstance(e, StudyStarted) and e.study_id == "tiny-b")
    before = {(e.node_id, e.from_step, e.to_step) for e in events[:at] if isinstance(e, StageFinished)}
    after = [(e.node_id, e.from_step, e.to_step) for e in events[at:] if isinstance(e, StageFinished)]
    assert not [s for s in after if any(n == s[0] and a_ < s[2] and s[1] < b_ for n, a_, b_ in before)]

    again = _run("tiny_sha_b.py", out)
    assert again.returncode == 2, again.stdout + again.stderr
    assert "'tiny-b'" in again.stderr and "--resume" in again.stderr
    assert len(_plan_events(out)) == len(events)  # the refused run appended nothing



def test_the_live_progress_counts_the_study_it_runs(two_studies: Simulation) -> None:
    """``stagetree run``'s progress line counts its own study's trials (a Kafka deployment runs
    other studies beside it: the line counted theirs), and its stages end equal: a lost or
    preempted dispatch's rest is counted once, in the dispatch that runs it again."""
    from rich.console import Console

    from stagetree.progress import render

    def line(study: str | None) -> str:
        console = Console(width=300, record=True)
        console.print(render(two_studies.state, "t", study))
        return console.export_text().splitlines()[0]

    assert "trials 2/2" in line("a") and "trials 3/3" in line("b") and "trials 5/5" in line(None)
    for study in ("a", "b", None):
        finished, total = re.search(r"stages (\d+)/(\d+)", line(study)).groups()
        assert finished == total and int(total) > 0
    # a dispatch lost before it finished anything, whose stages another dispatch then ran
    ran = next(d for d in two_studies.state.dispatches.values() if d.plan_key)
    two_studies.state.dispatches["lost-1"] = dataclasses.replace(ran, dispatch_id="lost-1", status="lost", finished=0)
    for study in ("a", None):
        finished, total = re.search(r"stages (\d+)/(\d+)", line(study)).groups()
        assert finished == total, line(study)


@pytest.mark.parametrize("shared", [False, True], ids=["nothing-shared", "prefixes-shared"])
def test_the_progress_line_saves_only_what_merging_spares(shared: bool, tmp_path: Path) -> None:
    """"steps saved" was the steps asked minus those trained so far: the work still to do (400
    at the start of a study that shares nothing). It is what merging spares: the steps asked
    minus the unique steps of the requests' paths, from the first request on, and at the end
    the steps asked minus those trained."""
    from rich.console import Console

    from gpu_worker.simulated import SimulatedTrainer
    from projections.state import State
    from projections.store import fold_records
    from stagetree.progress import render
    from stagetree.simulate import SimStudy, simulate
    from stagetree.tuners import GridSearch, GridSearchSpace

    lrs = [Constant(0.1), Piecewise([Constant(0.1), Constant(0.01)], [60])] if shared else [Constant(0.1),
                                                                                          Constant(0.2)]
    result = simulate(SimulatedTrainer("p", ("lr",)), [SimStudy("s", GridSearch(GridSearchSpace({"lr": lrs}), 100,
                                                                                 "val_acc"))],
                      workers=1, run_dir=tmp_path)
    seen: list[int] = []

    def after(offset: int, state: State) -> None:
        if len(state.trials) == 2:  # both asked (from the second record on)
            console = Console(width=300, record=True)
            console.print(render(state, "t", "s"))
            seen.append(int(re.search(r"steps saved (\d+)", console.export_text()).group(1)))

    with EmbeddedLog(tmp_path / "log", read_only=True) as log:
        fold_records(State(), log.read(topics.PLAN), after=after)
    expected = 200 - result.unique_steps
    assert result.executed_steps == result.unique_steps == (140 if shared else 200)
    assert seen and set(seen) == {expected}, seen


def test_the_progress_display_ends_its_last_line_where_output_is_no_terminal(two_studies: Simulation,
                                                                            capsys: pytest.CaptureFixture[str]
                                                                            ) -> None:
    """Piped or logged, what is printed after the progress display (the result) starts on a line
    of its own: it was glued onto the workers table's last row."""
    from stagetree.progress import Progress

    with Progress(lambda: two_studies.state, "t", study_id="a"):
        pass
    print("result")
    out = capsys.readouterr().out
    assert out.endswith("\nresult\n") and "trials 2/2" in out, out

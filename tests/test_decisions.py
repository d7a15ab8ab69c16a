"""Tuner decisions as events (issue 12): every tuner's decisions verify, and a log whose
decisions were edited, dropped or swapped (and re-sealed, as anyone can without a key) fails
``replay verify`` naming the offset; logs from before decisions were events verify with a note.

The studies (tests/studies/decisions.py) run on the cluster simulator: the real tuners, SDK,
embedded log, reducer and scheduler, with simulated workers on a virtual clock (a few tenths of
a second each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from partitioned import as_partitioned, separating

from events import topics
from events.codec import decode, encode
from events.decisions import Draw, Promote, Ranking, Stop
from events.log import CHAIN_START, Record, chain_next
from events.models import TunerDecided, WorkerJoined, WorkerLost
from gpu_worker.simulated import FormulaCurve
from projections.reducer import Rejected, apply
from projections.state import State
from projections.store import fold_records
from replay.audit import Source, export_log, open_source
from replay.decisions import replay_partitioned
from replay.tuner import check_study, plan_events
from stagetree import (
    ASHA,
    PBT,
    CostModel,
    GridSearch,
    GridSearchSpace,
    Hyperband,
    MedianStopping,
    SimulatedTrainer,
    SuccessiveHalving,
    hp,
)
from stagetree.cli import main
from stagetree.simulate import SimStudy, simulate
from stagetree.simulate_cli import load_simulation

STUDY = Path(__file__).parent / "studies" / "decisions.py"
OLD_LOG = Path(__file__).parent / "data" / "old_sha_log.jsonl"
NAMES = ["grid", "sha", "asha", "asha-causal", "hyperband", "median", "pbt", "mltuner", "early-stop"]
KINDS = {  # decision kinds each tuner must have taken in its study
    "grid": {"draw", "answer"},
    "sha": {"draw", "promote", "stop", "answer"},
    "asha": {"draw", "promote", "stop", "answer"},
    "asha-causal": {"draw", "promote", "stop", "answer"},
    "hyperband": {"draw", "promote", "stop", "answer"},
    "median": {"draw", "continue", "stop", "answer"},
    "pbt": {"draw", "continue", "exploit", "answer"},
    "mltuner": {"draw", "continue", "promote", "stop", "retune", "answer"},
    "early-stop": {"draw", "promote", "stop", "answer"},
}


def study(name: str) -> tuple[Any, SimStudy]:
    """A fresh trainer and study from the study file."""
    trainer, studies, _ = load_simulation(str(STUDY))
    return trainer, next(s for s in studies if s.name == name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each study simulated alone on 3 workers: name -> (run directory, JSONL export)."""
    root = tmp_path_factory.mktemp("decisions")
    out = {}
    for name in NAMES:
        trainer, s = study(name)
        run_dir = root / name
        simulate(trainer, [s], workers=3, run_dir=run_dir, study_file=str(STUDY))
        export = root / f"{name}.jsonl"
        export_log(open_source(run_dir), export)
        out[name] = (run_dir, export)
    return out


def decisions_in(path: Path) -> list[tuple[int, TunerDecided]]:
    return [(o, e) for o, e in plan_events(open_source(path)) if isinstance(e, TunerDecided)]


def verify_cli(path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    code = main(["replay", "verify", str(path), "--quiet", *extra])
    return code, capsys.readouterr().out


# ----------------------------------------------------------------------------- every tuner verifies


@pytest.mark.parametrize("name", NAMES)
def test_every_tuners_decisions_are_events_that_verify(name: str, runs: Any, capsys: Any) -> None:
    run_dir, export = runs[name]
    decided = decisions_in(run_dir)
    assert {e.decision.kind for _, e in decided} >= KINDS[name]
    # appended before the requests they cause, each recording a prefix before itself
    assert all(e.decided_at < offset for offset, e in decided)
    events = plan_events(open_source(run_dir))
    first_request = {}
    for offset, e in events:
        if e.type == "TrialSubmitted":
            first_request.setdefault(e.trial_id, offset)
    caused = {}
    for offset, e in decided:
        if isinstance(e.decision, Draw):
            caused.setdefault(e.decision.trial_id, offset)
    assert caused and all(caused[t] < first_request[t] for t in caused if t in first_request)
    # the answer is the recorded best trial
    answer = decided[-1][1].decision
    finished = next(e for _, e in events if e.type == "StudyFinished")
    assert answer.kind == "answer" and answer.trial_id == finished.best_trial
    for path in (run_dir, export):  # the study file is the one StudyStarted records
        code, out = verify_cli(path, capsys)
        assert code == 0, out
        assert f"ok tuner: {len(decided)} tuner decisions of 1 study recomputed from their log prefixes" in out


def test_the_reducer_records_each_decision_on_the_trials_it_names(runs: Any) -> None:
    run_dir, _ = runs["pbt"]
    state = open_source(run_dir)
    from replay.audit import fold

    folded = fold(state.streams[topics.PLAN])
    exploit = next(e for _, e in decisions_in(run_dir) if e.decision.kind == "exploit").decision
    roles = {t: [d.role for d in folded.decided[t] if d.decision["kind"] == "exploit"]
             for t in (exploit.trial_id, exploit.donor, exploit.new_trial_id)}
    assert roles[exploit.trial_id][0] == "trial" and "donor" in roles[exploit.donor]
    assert roles[exploit.new_trial_id][0] == "new"  # (it may exploit in turn at a later generation)
    # the new member's story starts with the exploit that made it
    assert folded.decided[exploit.new_trial_id][0].decision["kind"] == "exploit"


def test_a_decision_decided_at_or_after_its_own_offset_is_rejected() -> None:
    state = State()
    decision = Draw(trial_id="t", step=0, to_step=5, sampler="GridSearchSpace", index=0)
    event = TunerDecided(study_id="s", tuner="GridSearch", decided_at=4, decision=decision)
    with pytest.raises(Rejected, match="decided at offset 4, which is not before the decision's own offset 4"):
        apply(state, event, 4)
    assert not state.decided
    apply(state, event, 5)
    assert [d.offset for d in state.decided["t"]] == [5]


def test_a_tuner_that_decides_otherwise_is_named_at_the_first_decision_it_changes(runs: Any) -> None:
    """A tuner with the recorded settings whose code decides otherwise (here: it ranks the
    worst first, as a changed rule would that kept its version): the first decision it
    changes is named."""
    run_dir, _ = runs["sha"]
    trainer, s = study("sha")

    def other() -> Any:  # the same study file with a tuner whose ranking is reversed
        _, again = study("sha")
        tuner = again.tuner
        rank = tuner.rank
        tuner.rank = lambda results: list(reversed(rank(results)))
        return tuner

    assert check_study(run_dir, "sha", lambda: study("sha")[1].tuner, trainer).ok
    check = check_study(run_dir, "sha", other, trainer)
    first_cut = next(o for o, e in decisions_in(run_dir) if e.decision.kind in ("promote", "stop"))
    assert check.failure is not None and check.failure.offset == first_cut
    assert "recorded step 2: " in check.failure.detail and "SuccessiveHalving, rung 0" in check.failure.detail


@pytest.mark.parametrize(("change", "named"), [
    ("mode", '`mode`: "max" in the log, "min" now'),
    ("reduction", "`reduction`: 2 in the log, 3 now"),
    ("space", "`space.configurations`: 10 in the log, 4 now"),
    ("rules", "`rules`: 1 in the log, 2 now"),
])
def test_a_study_file_whose_tuner_settings_differ_is_named_at_its_run(change: str, named: str, runs: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run records its tuner's settings (class, rules version, arguments, a digest of the
    space): recomputed with a study file whose tuner differs, verify fails at the run's
    StudyStarted naming the first difference, instead of at the first decision that differs."""
    run_dir, _ = runs["sha"]
    trainer, s = study("sha")
    assert s.tuner.settings()["reduction"] == 2 and s.tuner.settings()["space"]["configurations"] == 10

    def other() -> Any:
        tuner = study("sha")[1].tuner
        if change == "mode":
            tuner.mode = "min"
        elif change == "reduction":
            tuner.reduction = 3
        elif change == "space":
            tuner.space = list(tuner.space)[:4]
        else:  # a stagetree whose SuccessiveHalving decides by other rules
            monkeypatch.setattr(SuccessiveHalving, "rules", 2)
        return tuner

    check = check_study(run_dir, "sha", other, trainer)
    start = next(o for o, e in plan_events(open_source(run_dir)) if e.type == "StudyStarted")
    assert check.failure is not None and check.failure.offset == start and check.failure.event == "StudyStarted"
    assert named in check.failure.detail and "pass --study with the study file the run used" in check.failure.detail
    assert check.checked == 0


# ----------------------------------------------------------------------------- tampering


def rows_of(export: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    lines = export.read_bytes().splitlines()
    return orjson.loads(lines[0]), [orjson.loads(x) for x in lines[1:]]


def reseal(header: dict[str, Any], rows: list[dict[str, Any]], out: Path) -> Path:
    """Write ``rows`` as an export with every stream's offsets renumbered from 0, its sha256
    chain recomputed and the header's projection digest refolded: a forgery anyone can make
    of a log chained without a key."""
    streams: dict[str, list[Record]] = {}
    heads: dict[str, bytes] = {}
    for row in rows:
        stream = row["stream"]
        recs = streams.setdefault(stream, [])
        value = row["value"].encode()
        chain = chain_next(heads.get(stream, CHAIN_START), stream, len(recs), row["key"], value)
        heads[stream] = chain
        recs.append(Record(stream, len(recs), row["key"], value, chain))
    export_log(Source(out, "export", streams, header["chain"], None), out)
    return out


def decision_rows(rows: list[dict[str, Any]]) -> list[int]:
    return [i for i, r in enumerate(rows) if r["stream"] == topics.PLAN and '"TunerDecided"' in r["value"]]


def edit_evidence(row: dict[str, Any]) -> None:
    event = orjson.loads(row["value"])
    evidence = event["payload"]["decision"]["evidence"]
    key = next(k for k in ("rank", "stale", "others", "length") if k in evidence)
    evidence[key] += 1
    row["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()


def tuner_failure(out: str) -> str:
    line = next((x for x in out.splitlines() if x.startswith("FAILED tuner:")), None)
    assert line is not None, out
    return line


@pytest.mark.parametrize("name", NAMES)
def test_an_edited_dropped_or_swapped_decision_fails_verify_at_its_offset(name: str, runs: Any, tmp_path: Path,
                                                                          capsys: Any) -> None:
    _, export = runs[name]
    header, rows = rows_of(export)
    at = decision_rows(rows)
    assert len(at) >= 3

    # edit the evidence of a decision in the middle (the answer for a grid: its only evidence)
    with_evidence = [i for i in at if orjson.loads(rows[i]["value"])["payload"]["decision"].get("evidence")]
    i = with_evidence[len(with_evidence) // 2]
    edited = [dict(r) for r in rows]
    edit_evidence(edited[i])
    code, out = verify_cli(reseal(header, edited, tmp_path / "edited.jsonl"), capsys)
    assert code == 1 and "ok chain:" in out  # re-sealed: only the recomputation can tell
    assert f"tuner check failed at offset {rows[i]['offset']} (TunerDecided)" in tuner_failure(out)

    # drop a decision: the next one is now where it was recorded and differs from what the tuner computes
    j = at[len(at) // 2]
    nxt = at[at.index(j) + 1]
    dropped = [dict(r) for k, r in enumerate(rows) if k != j]
    code, out = verify_cli(reseal(header, dropped, tmp_path / "dropped.jsonl"), capsys)
    assert code == 1
    assert f"tuner check failed at offset {rows[nxt]['offset'] - 1} (TunerDecided)" in tuner_failure(out)

    # swap two decisions of different trials (keeping their offsets)
    a = next(k for k, b in zip(at, at[1:]) if rows[k]["value"] != rows[b]["value"]
             and orjson.loads(rows[k]["value"])["payload"]["decision"]["trial_id"]
             != orjson.loads(rows[b]["value"])["payload"]["decision"]["trial_id"])
    b = at[at.index(a) + 1]
    swapped = [dict(r) for r in rows]
    swapped[a], swapped[b] = {**rows[b], "offset": rows[a]["offset"]}, {**rows[a], "offset": rows[b]["offset"]}
    code, out = verify_cli(reseal(header, swapped, tmp_path / "swapped.jsonl"), capsys)
    assert code == 1
    assert f"tuner check failed at offset {rows[a]['offset']} (TunerDecided)" in tuner_failure(out)


# ----------------------------------------------------------------------------- no study file, old logs


def test_without_a_study_file_verify_checks_the_rest_and_says_so(runs: Any, tmp_path: Path, capsys: Any) -> None:
    _, export = runs["asha"]
    header, rows = rows_of(export)
    for row in rows:  # as if the log came from another machine: its study file is not here
        if '"StudyStarted"' in row["value"]:
            row["value"] = row["value"].replace(str(STUDY), "/elsewhere/decisions.py")
    moved = reseal(header, rows, tmp_path / "moved.jsonl")
    code, out = verify_cli(moved, capsys)
    assert code == 0, out
    assert "skipped tuner: tuner decisions not recomputed; study 'asha': tuner decisions not recomputed: no " \
           "study file (the log names '/elsewhere/decisions.py'; pass --study FILE)" in out
    code, out = verify_cli(moved, capsys, "--study", str(STUDY))
    assert code == 0 and "tuner decisions of 1 study recomputed" in out, out
    code, out = verify_cli(moved, capsys, "--study", str(tmp_path / "missing.py"))
    assert code == 2


def test_a_log_written_before_decisions_were_events_verifies_with_a_note(tmp_path: Path, capsys: Any) -> None:
    """tests/data/old_sha_log.jsonl: tests/data/old_sha.py simulated and exported by stagetree
    before issue 12 (main at commit af8465c, issue 10); its header holds that version's projection
    digest."""
    assert not [e for _, e in plan_events(open_source(OLD_LOG)) if e.type == "TunerDecided"]
    for path in (OLD_LOG, tmp_path / "run"):
        if path != OLD_LOG:
            assert main(["log", "import", str(OLD_LOG), "--out", str(path)]) == 0
        code, out = verify_cli(path, capsys, "--study", str(OLD_LOG.parent / "old_sha.py"))
        assert code == 0, out
        assert "ok projection:" in out
        assert "ok tuner: not recomputed: the log holds no tuner decisions (its tuner recorded none" in out
        assert "or the log was written before decisions were events)" in out


# ----------------------------------------------------------------------------- the decision types


def test_decisions_describe_themselves_with_their_evidence() -> None:
    rank = Ranking(metric="val_acc", mode="max", value=0.961, rank=9, of=16, kept=4, threshold=0.9777)
    assert Stop(trial_id="t", step=120, reason="rank", rung=2, evidence=rank).describe("SuccessiveHalving") == \
        "step 120: stopped by SuccessiveHalving, rung 2: rank 9 of 16 by val_acc 0.9610, top 4 kept (threshold 0.9777)"
    assert Promote(trial_id="t", step=30, to_step=120, rung=0, evidence=rank).describe("ASHA").endswith("; to step 120")
    event = TunerDecided(study_id="s", tuner="ASHA", decided_at=3, decision=Promote(
        trial_id="t", step=30, to_step=120, rung=0, evidence=rank))
    from events.codec import encode

    assert decode(encode(event)) == event
    bad = orjson.loads(encode(event))
    bad["payload"]["decision"]["evidence"]["rank"] = 0
    from events.codec import InvalidEvent, from_dict

    with pytest.raises(InvalidEvent, match=r"decision\.promote\.evidence\.rank\.rank: Input should be greater than 0"):
        from_dict(bad)


# ----------------------------------------------------------------------------- failures


def x_unless_it_fails(values: dict[str, float], step: int) -> dict[str, float]:
    if values["x"] == 8.5 and step >= 2:  # promoted at step 1, fails after
        raise FloatingPointError("x = 8.5 diverged")  # the simulated trainer raises: StageFailed "error"
    return {"val_acc": float(values["x"]) + step / 100}


FAILING = {
    "grid": lambda sp: GridSearch(sp, 4, "val_acc"),
    "sha": lambda sp: SuccessiveHalving(sp, "val_acc", min_steps=1, max_steps=4, reduction=2),
    "asha": lambda sp: ASHA(sp, "val_acc", min_steps=1, max_steps=4, reduction=2),
    "median": lambda sp: MedianStopping(sp, "val_acc", max_steps=4, interval=1, min_trials=2),
    "pbt": lambda sp: PBT(sp, "val_acc", population=6, interval=1, max_steps=4, mutations={"x": [1, 2, 3]}),
    "hyperband": lambda sp: Hyperband(sp, "val_acc", min_steps=1, max_steps=4, reduction=2),
}


@pytest.mark.parametrize("name", sorted(FAILING))
def test_decisions_about_a_failed_trial_verify_in_arrival_order(name: str, tmp_path: Path) -> None:
    """A failed trial is a loss: a decision records it, and results handed over in arrival order,
    failures included, replay in the order the live tuner got them (on 3 workers)."""
    trainer = SimulatedTrainer("failing-x", ("x",), cost=CostModel(scale={"x": (1.0, 1.0)}),
                               curve=FormulaCurve(x_unless_it_fails))
    space = GridSearchSpace({"x": [hp.Constant(x) for x in (3, 1, 4, 8.5, 5, 9)]})
    result = simulate(trainer, [SimStudy("f", FAILING[name](space))], workers=3, run_dir=tmp_path)
    stopped = [d for d in result.results[0].decisions if d.kind == "stop" and d.reason == "failed"]
    assert stopped and result.summaries[0]["best_metric"] is not None
    check = check_study(tmp_path, "f", lambda: FAILING[name](space), trainer)
    assert check.ok, check.failure
    assert check.checked == len(result.results[0].decisions)


# ----------------------------------------------------------------------------- explain


def test_explain_tells_a_pbt_member_made_by_an_exploit_where_it_left_its_donor(runs: Any) -> None:
    from replay.explain import explain

    run_dir, export = runs["pbt"]
    exploits = [e.decision for _, e in decisions_in(run_dir) if e.decision.kind == "exploit"]
    state = open_source(run_dir)
    from replay.audit import fold

    trials = fold(state.streams[topics.PLAN]).trials
    exploit = next(x for x in exploits  # one whose exploration changed the value at the step
                   if trials[x.donor].hp["lr"].value(x.step) != x.explored["lr"])
    story = explain(export, exploit.new_trial_id)
    assert (story.decisions[0]["kind"], story.decisions[0]["role"]) == ("exploit", "new")
    assert {s["trial_id"]: s["diverges_at"] for s in story.shares_prefix_with}[exploit.donor] == exploit.step
    text = "\n".join(story.lines())
    assert f"step {exploit.step}: exploited by PBT: rank" in text and f"takes donor {exploit.donor}" in text
    assert story.stages and all(s["from_step"] >= 0 for s in story.stages)
    # the donor's own story names the exploit too, as the donor
    donor = explain(export, exploit.donor)
    assert any(d["kind"] == "exploit" and d["role"] == "donor" for d in donor.decisions)


def test_explain_on_a_log_without_decisions_says_so(capsys: Any) -> None:
    from replay.audit import fold

    trial = sorted(fold(open_source(OLD_LOG).streams[topics.PLAN]).trials)[0]
    assert main(["replay", "explain", str(OLD_LOG), trial[:12]]) == 0
    out = capsys.readouterr().out
    assert f"trial {trial} of study old-sha" in out and "decisions:\n  none" in out
    assert "note: the log holds no tuner decisions (its tuner recorded none, or the log was written before " \
        "decisions were events)" in out


def test_a_request_no_decision_makes_fails_verify_at_its_offset(runs: Any, tmp_path: Path, capsys: Any) -> None:
    """A forged TrialSubmitted (another configuration, re-sealed) is a request the tuner never made."""
    _, export = runs["sha"]
    header, rows = rows_of(export)
    i = max(k for k, r in enumerate(rows) if r["stream"] == topics.PLAN and '"TrialSubmitted"' in r["value"])
    forged = orjson.loads(rows[i]["value"])
    forged["event_id"] = "f" * 32
    forged["payload"]["steps"] += 1  # one step more than promoted to
    rows.insert(i + 1, {**rows[i], "value": orjson.dumps(forged, option=orjson.OPT_SORT_KEYS).decode()})
    code, out = verify_cli(reseal(header, rows, tmp_path / "forged.jsonl"), capsys)
    assert code == 1
    assert (f"tuner check failed at offset {rows[i]['offset'] + 1} (TrialSubmitted): trial "
            f"{forged['payload']['trial_id']}: a request for {forged['payload']['steps']} steps") in tuner_failure(out)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "no-merge"])
def test_decisions_recompute_from_a_partitioned_plan_stream(merge: bool, tmp_path: Path) -> None:
    """On Kafka the plan stream has several partitions: a study and its decisions live in the
    partition of its plan key (its ``--no-merge`` trials in their own plans' partitions), and a
    decision records every partition's prefix. The decisions recompute from exactly those
    prefixes, and a tuner that decides otherwise is still named at its first changed decision."""
    trainer, s = study("asha")
    simulate(trainer, [s], workers=3, merge=merge, run_dir=tmp_path / "run")
    records = open_source(tmp_path / "run").streams[topics.PLAN]
    events = [decode(r.value) for r in records]
    keys = {e.plan_key for e in events if e.type in ("StudyStarted", "TrialSubmitted")}
    spread = as_partitioned(records, separating(list(keys)[:4]))
    assert len({r.partition for r in spread}) > 1
    source = Source(tmp_path / "kafka", "kafka", {topics.PLAN: spread}, "sealed", None)
    check = check_study(source, "asha", lambda: study("asha")[1].tuner, trainer)
    assert check.ok, check.failure
    assert check.checked == sum(e.type == "TunerDecided" for e in events) > 0

    def other() -> Any:
        tuner = study("asha")[1].tuner
        tuner.mode = "min"
        return tuner

    failed = check_study(source, "asha", other, trainer).failure
    assert failed is not None and "recorded " in failed.detail


def _broadcast(events: list[Any], partitions: int) -> dict[int, list[Record]]:
    """Every event to every partition (as the Kafka transport writes WorkerJoined and WorkerLost),
    each encoded once: its copies are one event (one event_id); offsets with gaps."""
    parts: dict[int, list[Record]] = {p: [] for p in range(partitions)}
    for i, event in enumerate(events):
        value = encode(event)
        for p in range(partitions):
            parts[p].append(Record(topics.PLAN, 2 * i + 1, "worker", value, b"", p))
    return parts


def test_a_worker_lost_broadcast_to_every_partition_is_one_decision_checked_once() -> None:
    """``stagetree serve`` writes a WorkerLost it decided to every plan partition: verify checks
    it once (the worker was alive in its prefix), and still catches a second, different decision
    at the same prefix and one about a worker that was not alive there."""
    prefix = {p: 1 for p in range(3)}
    joined = WorkerJoined(worker_id="w0", device="cpu")

    def lost(worker_id: str = "w0") -> WorkerLost:
        return WorkerLost(worker_id=worker_id, reason="no heartbeat for 3 s", decided_at_partitions=prefix)

    def check(events: list[Any]) -> tuple[Any, dict[str, int]]:
        mismatch, checked, _ = replay_partitioned(_broadcast(events, 3), lambda st, recs: fold_records(st, recs))
        return mismatch, checked

    assert check([joined, lost()]) == (None, {"liveness": 1})
    twice, _ = check([joined, lost(), lost()])
    assert twice is not None and "computes w0 lost" in twice.detail, twice
    stranger, _ = check([joined, lost("w9")])
    assert stranger is not None and "computes nothing" in stranger.detail, stranger


def test_same_decision_compares_every_field_but_the_header() -> None:
    """What verify compares a recorded decision with: equal payloads, whatever the event id,
    producer, timestamp and trace; any field of the decision, nested ones included, tells them
    apart, as does the event type."""
    from events.hp import Constant, MultiStep
    from events.models import CheckpointSource, StageDispatched, StageSpec
    from replay.decisions import same_decision

    def dispatch(to_step: int = 5, lr: float = 0.1, ref: str = "a" * 64, **header: Any) -> StageDispatched:
        return StageDispatched(dispatch_id="d1", worker_id="w0", plan_key="p", seed=3, decided_at=7, policy="bfs",
                               source=CheckpointSource(node_id="n1", step=2, ref=ref),
                               stages=[StageSpec(node_id="n2", hp={"lr": MultiStep(lr, [3], 0.5), "bs": Constant(16)},
                                                 from_step=2, to_step=to_step, evaluate=True)], **header)

    recorded = decode(encode(dispatch(producer="scheduler", ts=12.5, trace={"traceparent": "00-" + "1" * 32 + "-"
                                                                                           + "2" * 16 + "-01"})))
    assert same_decision(dispatch(), recorded) and same_decision(recorded, dispatch())
    assert recorded.event_id != dispatch().event_id
    for other in (dispatch(to_step=6), dispatch(lr=0.2), dispatch(ref="b" * 64),
                  dispatch().model_copy(update={"policy": "critical-path"}),
                  dispatch().model_copy(update={"decided_at": 8})):
        assert not same_decision(other, recorded)
    # the rules version is checked apart: a decision recording none compares with its recomputation
    assert same_decision(dispatch(rules=1), recorded) and same_decision(recorded, dispatch(rules=1))
    assert not same_decision(WorkerLost(worker_id="w0", reason="gone"), WorkerJoined(worker_id="w0", device="cpu"))

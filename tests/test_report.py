"""`stagetree report`: the HTML report of a real run (tiny SHA study, 2 worker processes).

The study runs once for the module; each test builds reports from it. Checked: the audit banner
(not audited / passed / failed with the first failure, escaped), the merge-savings table equals
summary.json (or the same numbers recomputed from the log when summary.json is missing), every
picture is a real PNG, a merged run has shared stages; and, on hand-made states, which stages are
shared (none in a --no-merge plan per trial), how stages link to their parents, and how
StageStarted/StageFinished/StageFailed pair up.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from events.hp import Constant
from events.models import (
    StageDispatched,
    StageFailed,
    StageFinished,
    StageSpec,
    StageStarted,
    StageStopped,
    WorkerLost,
)
from projections.state import Node, Plan, State, Trial
from projections.summary import summary_path
from replay import audit  # our own module: an import regression must fail, never skip
from replay.report import (
    PICTURES,
    SAVINGS_ROWS,
    ReportError,
    StageRun,
    build_report,
    main,
    stage_runs,
    stage_tree,
    trial_path,
)

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "tests" / "studies" / "tiny_sha.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("report") / "run"
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(STUDY), "--workers", "2",
                           "--out", str(out), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="module")
def summary(run_dir: Path) -> dict:
    return orjson.loads((run_dir / "summary.json").read_bytes())


@pytest.fixture(scope="module")
def report(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    index = build_report(run_dir, tmp_path_factory.mktemp("report") / "plain")
    return index, index.read_text(encoding="utf-8")


def table(doc: str) -> dict[str, object]:
    """The savings table's cells: data-key -> the JSON value in data-value."""
    return {k: json.loads(html.unescape(v)) for k, v in re.findall(r'data-key="([^"]+)" data-value="([^"]*)"', doc)}


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------- a real run


@pytest.mark.e2e
def test_report_of_a_run_is_one_html_file_with_its_pictures(report: tuple[Path, str]) -> None:
    index, doc = report
    assert index.name == "index.html"
    assert doc.startswith("<!DOCTYPE html>") and "<style>" in doc and "<script" not in doc
    for name in PICTURES:
        path = index.parent / name
        assert f'<img src="{name}"' in doc
        assert path.stat().st_size > 1024, f"{name} is only {path.stat().st_size} bytes"
        width, height = png_size(path)
        assert width > 300 and height > 150, (name, width, height)
    for section in ('id="audit"', 'id="savings"', 'id="stage-tree"', 'id="gantt"', 'id="curves"', 'id="trials"'):
        assert section in doc


@pytest.mark.e2e
def test_unaudited_report_says_so_first(report: tuple[Path, str]) -> None:
    _, doc = report
    assert 'class="audit none"' in doc
    assert "not audited — run <code>stagetree replay verify</code>" in doc
    body = doc[doc.index("<main>"):]
    assert body.index('id="audit"') < min(body.index(s) for s in ('id="savings"', 'id="stage-tree"', 'id="gantt"'))


@pytest.mark.e2e
def test_savings_table_equals_summary_json(report: tuple[Path, str], summary: dict) -> None:
    cells = table(report[1])
    for key, _, _ in SAVINGS_ROWS:
        assert cells[key] == summary[key], key
    assert cells["best_trial"] == summary["best_trial"]
    assert cells["best_metric"] == summary["best_metric"]
    assert cells["saved_steps"] == summary["total_steps"] - summary["executed_steps"]
    assert f">{summary['total_steps']:,}<" in report[1]


@pytest.mark.e2e
def test_merged_run_has_shared_stages(report: tuple[Path, str], summary: dict) -> None:
    assert summary["mode"] == "merged" and summary["merge_rate"] > 1
    assert table(report[1])["shared_stages"] > 0


@pytest.mark.e2e
def test_failed_audit_shows_the_first_failure_escaped(run_dir: Path, tmp_path: Path) -> None:
    first = "chain check failed at offset 42 (MetricsReported): stream <script>alert(1)</script> edited"
    audit = {"ok": False, "first_failure": first, "checks": [
        {"name": "chain", "ok": False, "detail": first},
        {"name": "decision", "ok": True, "detail": "16 dispatch decisions recomputed"},
    ]}
    doc = build_report(run_dir, tmp_path / "failed", audit).read_text(encoding="utf-8")
    assert 'class="audit fail"' in doc and "Audit FAILED" in doc
    assert f"First failure: {html.escape(first)}" in doc
    assert "<script>" not in doc and "&lt;script&gt;alert(1)&lt;/script&gt;" in doc
    assert "16 dispatch decisions recomputed" in doc


@pytest.mark.e2e
def test_passed_audit_is_green(run_dir: Path, tmp_path: Path) -> None:
    audit = {"ok": True, "first_failure": None, "checks": [{"name": "chain", "ok": True, "detail": "all chained"}]}
    doc = build_report(run_dir, tmp_path / "ok", audit).read_text(encoding="utf-8")
    assert 'class="audit ok"' in doc and "Audit passed" in doc and "all chained" in doc
    assert "not audited" not in doc


@pytest.mark.e2e
def test_cli_reads_an_audit_file_and_rejects_bad_input(run_dir: Path, tmp_path: Path) -> None:
    audit = tmp_path / "audit.json"
    audit.write_bytes(orjson.dumps({"ok": False, "checks": [], "first_failure": "projection check failed at x"}))
    assert main([str(run_dir), "--out", str(tmp_path / "cli"), "--audit", str(audit)]) == 0
    assert "First failure: projection check failed at x" in (tmp_path / "cli" / "index.html").read_text()
    assert main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert main([str(tmp_path), "--out", str(tmp_path / "x")]) == 2  # a directory without log/
    (tmp_path / "bad.json").write_text("{not json")
    assert main([str(run_dir), "--out", str(tmp_path / "x"), "--audit", str(tmp_path / "bad.json")]) == 2
    with pytest.raises(ReportError, match="does not exist"):
        build_report(tmp_path / "nothing", tmp_path / "x")


@pytest.mark.e2e
def test_cli_verify_runs_the_audit(run_dir: Path, summary: dict, tmp_path: Path) -> None:
    """The audit banner, with the anchor of what was audited (the run's own, as its summary
    keeps it), and the tuner the study recorded in the header."""
    assert main([str(run_dir), "--out", str(tmp_path / "v"), "--verify"]) == 0
    doc = (tmp_path / "v" / "index.html").read_text()
    assert 'class="audit ok"' in doc, doc[doc.index('id="audit"'):][:2000]
    assert f"Anchor of the log audited: <code>{summary['log_anchor']}</code>" in doc
    assert "tuner <code>SuccessiveHalving(max_steps=160, metric=&quot;val_acc&quot;, min_steps=10, " \
           "mode=&quot;max&quot;, reduction=2) on GridSearchSpace(configurations=16), rules 1</code>" in doc, doc[:3000]


@pytest.mark.e2e
def test_without_summary_json_the_table_is_computed_from_the_log(run_dir: Path, summary: dict,
                                                                  tmp_path: Path) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "summary.json").unlink()
    summary_path(copy, summary["name"]).unlink()  # every study's own summary too
    doc = build_report(copy, tmp_path / "out").read_text(encoding="utf-8")
    assert "computed from the log" in doc
    cells = table(doc)
    for key, _, _ in SAVINGS_ROWS:
        assert cells[key] == pytest.approx(summary[key]), key
    assert cells["best_trial"] == summary["best_trial"]


# ----------------------------------------------------------------------------- hand-made states

HP = {"lr": Constant(0.1)}


def plan_state(plans: dict[str, list[tuple[str, str | None, int]]], trials: list[tuple[str, str, str, int]]) -> State:
    """plans: plan_key -> [(node_id, parent_id, start_step)]; trials: (trial_id, plan_key, node, steps)."""
    state = State()
    for plan_key, nodes in plans.items():
        plan = Plan(plan_key, 0)
        for node_id, parent, start in nodes:
            plan.nodes[node_id] = Node(node_id, plan_key, parent, start, 0, HP)
            if parent is None:
                plan.roots.append(node_id)
            else:
                plan.nodes[parent].children.append(node_id)
        state.plans[plan_key] = plan
    for trial_id, plan_key, node, steps in trials:
        state.trials[trial_id] = Trial(trial_id, "s", plan_key, HP, steps, {steps: node})
    return state


def finished(plan_key: str, node: str, a: int, b: int) -> StageRun:
    return StageRun(plan_key, node, a, b, "d", "w0", 0.0, 1.0, "finished")


def test_shared_stages_and_parents_in_a_merged_plan() -> None:
    # n0 [0, 20) under trials A, B, C; n1 branches from n0 at 20 for A; C stops at 10
    state = plan_state({"p": [("n0", None, 0), ("n1", "n0", 20)]},
                       [("A", "p", "n1", 40), ("B", "p", "n0", 30), ("C", "p", "n0", 10)])
    runs = [finished("p", "n0", 0, 10), finished("p", "n0", 10, 20), finished("p", "n1", 20, 40),
            finished("p", "n0", 20, 30)]
    stages = {(s.node_id, s.from_step, s.to_step): s for s in stage_tree(state, runs)}
    assert stages[("n0", 0, 10)].trials == {"A", "B", "C"}
    assert stages[("n0", 10, 20)].trials == {"A", "B"}
    assert stages[("n1", 20, 40)].trials == {"A"} and not stages[("n1", 20, 40)].shared
    assert stages[("n0", 20, 30)].trials == {"B"}
    ordered = stage_tree(state, runs)
    parent = {(s.node_id, s.from_step): ordered[s.parent].node_id + str(ordered[s.parent].from_step)
              if s.parent is not None else None for s in ordered}
    assert parent == {("n0", 0): None, ("n0", 10): "n00", ("n1", 20): "n010", ("n0", 20): "n010"}
    assert [s.row for s in ordered] == list(range(4))
    assert all(s.parent is None or s.parent < s.row for s in ordered)  # parents are drawn above
    assert trial_path(state, state.trials["A"]) == [("p", "n1", 20, 40), ("p", "n0", 0, 20)]


def test_no_merge_plans_share_nothing() -> None:
    state = plan_state({"k/trial/A": [("n0", None, 0)], "k/trial/B": [("n0", None, 0)]},
                       [("A", "k/trial/A", "n0", 20), ("B", "k/trial/B", "n0", 20)])
    runs = [finished(pk, "n0", a, b) for pk in ("k/trial/A", "k/trial/B") for a, b in ((0, 10), (10, 20))]
    stages = stage_tree(state, runs)
    assert len(stages) == 4 and not any(s.shared for s in stages)
    assert all(len(s.trials) == 1 for s in stages)


def test_retrained_stage_is_one_row_counted_twice() -> None:
    state = plan_state({"p": [("n0", None, 0)]}, [("A", "p", "n0", 10), ("B", "p", "n0", 10)])
    stages = stage_tree(state, [finished("p", "n0", 0, 10), finished("p", "n0", 0, 10)])
    assert len(stages) == 1 and stages[0].executions == 2 and stages[0].shared


def test_stage_runs_pair_start_and_end_events() -> None:
    spec = StageSpec(node_id="n0", hp=HP, from_step=0, to_step=10, evaluate=True)
    events = [
        StageDispatched(ts=100.0, dispatch_id="d0", worker_id="w0", plan_key="p", seed=0, decided_at=0, source=None,
                        stages=[spec]),
        StageStarted(ts=101.0, dispatch_id="d0", worker_id="w0", node_id="n0", from_step=0, to_step=10),
        StageDispatched(ts=101.5, dispatch_id="d1", worker_id="w1", plan_key="p", seed=0, decided_at=1, source=None,
                        stages=[spec]),
        StageStarted(ts=102.0, dispatch_id="d1", worker_id="w1", node_id="n0", from_step=0, to_step=10),
        StageFinished(ts=103.0, dispatch_id="d0", worker_id="w0", plan_key="p", node_id="n0", from_step=0,
                      to_step=10, seconds=2.0, train_seconds=1.5),
        WorkerLost(ts=104.0, worker_id="w1", reason="heartbeat"),
        StageStarted(ts=105.0, dispatch_id="d1", worker_id="w2", node_id="n0", from_step=0, to_step=10),
        StageFailed(ts=106.0, dispatch_id="d1", worker_id="w2", plan_key="p", node_id="n0", from_step=0,
                    to_step=10, kind="error", error="boom"),
        StageDispatched(ts=107.0, dispatch_id="d2", worker_id="w0", plan_key="p", seed=0, decided_at=8, source=None,
                        stages=[spec]),
        StageStarted(ts=108.0, dispatch_id="d2", worker_id="w0", node_id="n0", from_step=0, to_step=10),
        StageStopped(ts=109.5, dispatch_id="d2", worker_id="w0", plan_key="p", node_id="n0", from_step=0,
                     to_step=10, step=4, seconds=1.5, train_seconds=1.0),
    ]
    runs = stage_runs(list(enumerate(events)))
    assert [(r.worker_id, r.status, r.start_ts, r.end_ts) for r in runs] == [
        ("w0", "finished", 101.0, 103.0), ("w1", "unfinished", 102.0, 104.0), ("w2", "failed", 105.0, 106.0),
        ("w0", "stopped", 108.0, 109.5)]
    assert all(r.plan_key == "p" for r in runs)
    assert [r.stopped_at for r in runs] == [None, None, None, 4]


@pytest.mark.e2e
def test_report_of_a_jsonl_export(run_dir: Path, summary: dict, tmp_path: Path) -> None:
    export = tmp_path / "run.jsonl"
    audit.export_log(audit.open_source(run_dir), export)
    doc = build_report(export, tmp_path / "out").read_text(encoding="utf-8")
    cells = table(doc)
    for key, _, _ in SAVINGS_ROWS:
        assert cells[key] == pytest.approx(summary[key]), key
    assert cells["shared_stages"] > 0


# ----------------------------------------------------------------------------- a simulated run


def test_report_of_a_simulated_run_shows_idle_worker_time(tmp_path: Path) -> None:
    from events.hp import MultiStep
    from gpu_worker.simulated import CostModel, SimulatedTrainer
    from stagetree.simulate import SimStudy, simulate
    from stagetree.tuners import GridSearch, GridSearchSpace

    trainer = SimulatedTrainer("report-sim", ("lr",), cost=CostModel(base_seconds=2.0, save_seconds=1.0))
    space = GridSearchSpace({"lr": [Constant(0.1), MultiStep(0.1, (4,), 0.1), MultiStep(0.1, (8,), 0.1)]})
    run = tmp_path / "run"
    result = simulate(trainer, [SimStudy("sim", GridSearch(space, 10, metric="val_acc"))], workers=3, run_dir=run)
    expected = result.summaries[0]
    capacity = 3 * expected["end_to_end_seconds"]
    assert expected["idle_worker_seconds"] == pytest.approx(capacity - expected["worker_seconds"])
    assert expected["idle_worker_seconds"] > 0  # three workers, one shared prefix: some wait

    doc = build_report(run, tmp_path / "out").read_text(encoding="utf-8")  # no summary file: from the log
    cells = table(doc)
    assert "computed from the log" in doc and "Simulated by <code>stagetree simulate</code>" in doc
    assert cells["idle_worker_seconds"] == pytest.approx(expected["idle_worker_seconds"])
    assert cells["idle_ratio"] == pytest.approx(expected["idle_worker_seconds"] / capacity)
    assert "idle worker time (includes causal-order waiting, if the tuner used it)" in doc
    assert cells["end_to_end_seconds"] == pytest.approx(expected["end_to_end_seconds"])  # virtual, not 1e9 s
    for name in PICTURES:
        assert png_size(tmp_path / "out" / name)[0] > 300

    # `stagetree simulate --out` writes summary-<study>.json: the report reads it
    (run / "summary-sim.json").write_bytes(orjson.dumps(expected))
    doc = build_report(run, tmp_path / "out2").read_text(encoding="utf-8")
    assert "from summary-sim.json" in doc
    assert table(doc)["idle_worker_seconds"] == expected["idle_worker_seconds"]


def test_the_trial_table_gives_each_final_decision_and_the_curves_mark_them(tmp_path: Path) -> None:
    """Issue 12: the table names each trial's last decision with its reason; the learning curves
    mark every promotion and stop where it was decided."""
    from events.decisions import decision_from_json
    from projections.queries import decision_marks
    from replay.audit import fold, open_source
    from replay.report.pictures import plot_curves
    from stagetree.simulate import simulate
    from stagetree.simulate_cli import load_simulation

    trainer, studies, _ = load_simulation(str(ROOT / "tests" / "studies" / "decisions.py"))
    run = tmp_path / "run"
    simulate(trainer, [s for s in studies if s.name == "sha"], workers=2, run_dir=run)
    doc = build_report(run, tmp_path / "out").read_text(encoding="utf-8")
    state = fold(open_source(run).streams["stagetree.plan"])
    rows = dict(re.findall(r"<tr(?: class=\"best\")?><td>([0-9a-f]{16})</td>(.*?)</tr>", doc))
    assert len(rows) == len(state.trials) == 10
    stops = promotions = 0
    for trial_id, decided in state.decided.items():
        last = decided[-1]
        assert html.escape(decision_from_json(last.decision).describe(last.tuner), quote=True) in rows[trial_id]
        stops += sum(1 for d in decided if d.decision["kind"] == "stop")
        promotions += sum(1 for d in decided if d.decision["kind"] == "promote")
    assert "stopped by SuccessiveHalving, rung 0: rank" in doc and "chosen as the answer by SuccessiveHalving" in doc
    assert "a green triangle where a trial was promoted" in doc
    trials = list(state.trials.values())
    marks = {t.trial_id: decision_marks(state, t.trial_id) for t in trials}
    assert plot_curves(trials, "val_acc", None, tmp_path / "c.png", marks) == {"promote": promotions, "stop": stops}
    assert (stops, promotions) == (9, 8)  # rungs 2, 4, 8, 16 keep 10 -> 5 -> 2 -> 1: 5 + 3 + 1 stop, 5 + 2 + 1 go on


def test_report_of_one_study_in_a_log_of_several(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--study`` picks the study a report is about (it was always the directory's first);
    a study the log does not hold is bad input, naming the ones it does."""
    from gpu_worker.simulated import CostModel, SimulatedTrainer
    from stagetree.simulate import SimStudy, simulate
    from stagetree.tuners import GridSearch, GridSearchSpace

    trainer = SimulatedTrainer("report-two", ("lr",), cost=CostModel(base_seconds=1.0))
    a = GridSearchSpace({"lr": [Constant(0.1), Constant(0.2)]})
    b = GridSearchSpace({"lr": [Constant(0.1), Constant(0.3), Constant(0.4)]})
    run = tmp_path / "run"
    result = simulate(trainer, [SimStudy("a", GridSearch(a, 4, metric="val_acc")),
                                SimStudy("b", GridSearch(b, 4, metric="val_acc"))], workers=2, run_dir=run)
    for summary in result.summaries:
        summary_path(run, summary["name"]).write_bytes(orjson.dumps(summary))
    (run / "summary.json").write_bytes(orjson.dumps(result.summaries[0]))

    first = build_report(run, tmp_path / "first").read_text(encoding="utf-8")
    second = build_report(run, tmp_path / "second", study="b").read_text(encoding="utf-8")
    assert "stagetree report: a</h1>" in first and "2 trials" in first
    assert "stagetree report: b</h1>" in second and "3 trials" in second and "from summary-b.json" in second
    assert table(second)["total_steps"] == 3 * 4

    assert main([str(run), "--out", str(tmp_path / "x"), "--study", "c"]) == 2
    err = capsys.readouterr().err
    assert "--study 'c'" in err and "'a', 'b'" in err

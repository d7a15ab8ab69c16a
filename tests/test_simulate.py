"""The cluster simulator (``stagetree simulate``): real log, reducer, scheduler and tuners on
simulated GPUs with a virtual clock.

Invariants checked: without merging every trial's steps are trained (executed = total); with
merging no step is trained twice (executed = unique) whatever the policy; a simulation is
deterministic; its log passes ``replay verify``; the papers' 448-trial study runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from events.hp import Constant, MultiStep, Piecewise, Warmup
from gpu_worker.simulated import CostModel, CurveModel, SimulatedTrainer
from projections.store import ProjectionStore
from replay.audit import open_source, verify
from stagetree.cli import main
from stagetree.simulate import SimStudy, simulate
from stagetree.tuners import GridSearch, GridSearchSpace, SuccessiveHalving

ROOT = Path(__file__).resolve().parents[1]
TRAINER = SimulatedTrainer("toy", ("lr", "batch_size"),
                           cost=CostModel(2.0, {"batch_size": (128, -0.3)}, load_seconds=1.0, save_seconds=1.0),
                           curve=CurveModel())
SPACE = GridSearchSpace({
    "lr": [MultiStep(0.1, (30,), 0.1), Constant(0.1), MultiStep(0.1, (20, 40), 0.2), Warmup(0.01, 5, Constant(0.1))],
    "batch_size": [Constant(128), MultiStep(128, (25,), 2)],
})


@pytest.mark.parametrize("policy", ["critical-path", "bfs", "most-children"])
def test_grid_search_executes_unique_steps_merged_and_total_steps_trial_based(policy: str) -> None:
    merged = simulate(TRAINER, [SimStudy("g", GridSearch(SPACE, 60, "val_acc"))], workers=3, policy=policy)
    trial = simulate(TRAINER, [SimStudy("g", GridSearch(SPACE, 60, "val_acc"))], workers=3, merge=False,
                     policy=policy)
    assert merged.total_steps == trial.total_steps == 8 * 60
    assert merged.executed_steps == merged.unique_steps < merged.total_steps
    assert trial.executed_steps == trial.total_steps
    # Same answers in both modes (split invariance of the simulated training).
    assert [(t["trial_id"], t["metrics"]) for t in merged.summaries[0]["trials"]] == \
        [(t["trial_id"], t["metrics"]) for t in trial.summaries[0]["trials"]]
    assert merged.worker_seconds < trial.worker_seconds


def test_simulation_is_deterministic_and_its_log_verifies(tmp_path: Path) -> None:
    def once(d: Path) -> tuple:
        r = simulate(TRAINER, [SimStudy("sha", SuccessiveHalving(SPACE, "val_acc", min_steps=10, max_steps=60,
                                                                  reduction=2))], workers=3, run_dir=d)
        return r.makespan_seconds, r.worker_seconds, r.summaries[0]["trials"], r.summaries[0]["best_trial"]

    assert once(tmp_path / "a") == once(tmp_path / "b")
    result = verify(open_source(tmp_path / "a"))
    assert result.ok, result.first_failure
    assert {c["name"] for c in result.checks if c["ok"]} >= {"chain", "decision", "projection"}


def test_more_workers_shorten_the_makespan_not_the_gpu_time() -> None:
    runs = [simulate(TRAINER, [SimStudy("g", GridSearch(SPACE, 60, "val_acc"))], workers=w) for w in (1, 4)]
    assert runs[1].makespan_seconds < runs[0].makespan_seconds
    assert runs[0].idle_worker_seconds == pytest.approx(0.0, abs=1e-6)
    assert runs[0].executed_steps == runs[1].executed_steps


def test_two_concurrent_studies_share_one_plan() -> None:
    a = GridSearch(GridSearchSpace({"lr": SPACE.candidates["lr"][:3], "batch_size": [Constant(128)]}), 60, "val_acc")
    b = GridSearch(GridSearchSpace({"lr": SPACE.candidates["lr"][1:], "batch_size": [Constant(128)]}), 60, "val_acc")
    result = simulate(TRAINER, [SimStudy("a", a), SimStudy("b", b)], workers=2)
    assert result.executed_steps == result.unique_steps  # the union, each step once
    alone = [simulate(TRAINER, [SimStudy(n, t)], workers=2).executed_steps for n, t in
             (("a", GridSearch(a.space, 60, "val_acc")), ("b", GridSearch(b.space, 60, "val_acc")))]
    assert result.executed_steps < sum(alone)
    summary = result.summaries[1]
    assert summary["studies_sharing_plan"] == ["a", "b"]
    assert summary["k_wise_merge_rate"] == pytest.approx(result.total_steps / result.unique_steps)


def test_studies_with_other_seeds_share_nothing_and_the_totals_say_so() -> None:
    """Two studies of the same space with other seeds are on two plans: the simulation's unique
    steps are the sum of each plan's own, so executed = unique merged, and q is each study's p,
    as their summaries say (before, the two plans' trials were merged as one: unique halved)."""
    space = GridSearchSpace({"lr": SPACE.candidates["lr"][:2], "batch_size": [Constant(128)]})
    result = simulate(TRAINER, [SimStudy("a", GridSearch(space, 60, "val_acc"), seed=1),
                                SimStudy("b", GridSearch(space, 60, "val_acc"), seed=2)], workers=2)
    alone = simulate(TRAINER, [SimStudy("a", GridSearch(space, 60, "val_acc"), seed=1)], workers=2)
    assert result.total_steps == 4 * 60 and result.unique_steps == 2 * alone.unique_steps
    assert result.executed_steps == result.unique_steps
    assert [s["studies_sharing_plan"] for s in result.summaries] == [["a"], ["b"]]
    assert result.summaries[0]["k_wise_merge_rate"] == pytest.approx(alone.total_steps / alone.unique_steps)


def test_the_papers_resnet56_sha_study_runs_at_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    assert main(["simulate", str(ROOT / "examples/paper/resnet56_sha.py"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    merged, trial = report["runs"]["merged"], report["runs"]["trial"]
    assert report["workers"] == 40
    assert merged["total_steps"] == trial["total_steps"] == 448 * 15 + 112 * 45 + 28 * 60  # SHA rungs 15/60/120
    assert merged["executed_steps"] == merged["unique_steps"]
    assert trial["executed_steps"] == trial["total_steps"]
    assert report["gpu_hours_ratio"] > 1 and report["end_to_end_ratio"] > 1
    assert "trial-based / merged" in capsys.readouterr().out


def test_the_papers_bert_space_merges_as_the_paper_counts() -> None:
    """Hippo Table 1: BERT-Base's 40 trials have p = 2.045 (ours: 2.000). Its sequence-length
    schedules were written as float MultiSteps, 384.0 before their milestone, which is not the int
    384 of the constant schedule, so those trials shared nothing and p fell to 1.44 unnoticed."""
    sys.path.insert(0, str(ROOT / "examples" / "paper"))
    try:
        from _paper import bert_space
    finally:
        sys.path.remove(str(ROOT / "examples" / "paper"))
    from projections.search_plan import merged_unique_steps

    configs = list(bert_space())
    assert len(configs) == 40
    assert 40 * 27000 / merged_unique_steps([(c, 27000) for c in configs]) == 2.0


def test_simulate_bad_input_exits_2(tmp_path: Path) -> None:
    assert main(["simulate", str(tmp_path / "missing.py")]) == 2
    bad = tmp_path / "bad.py"
    bad.write_text("from gpu_worker.simulated import SimulatedTrainer\n"
                   "trainer = SimulatedTrainer('t', ('x',))\nworkers = 0\n"
                   "from stagetree.tuners import GridSearch, GridSearchSpace\n"
                   "tuner = GridSearch(GridSearchSpace({'x': [1]}), 3, 'val_acc')\n")
    assert main(["simulate", str(bad)]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", str(bad), "--policy", "random"])


def test_a_tuner_metric_the_trainer_does_not_report_is_a_clear_error_at_the_first_answer() -> None:
    from stagetree.errors import MetricNotReported

    with pytest.raises(MetricNotReported) as info:
        simulate(TRAINER, [SimStudy("typo", GridSearch(SPACE, 40, "val_accuracy"))], workers=2)
    assert "`metric` is 'val_accuracy'" in str(info.value) and "'val_acc'" in str(info.value)


def test_simulate_outputs_are_checked_before_it_runs_and_a_kept_simulation_is_never_overwritten(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    study = tmp_path / "grid.py"
    study.write_text("from gpu_worker.simulated import SimulatedTrainer\n"
                     "from stagetree.tuners import GridSearch, GridSearchSpace\n"
                     "trainer = SimulatedTrainer('t', ('x',))\n"
                     "tuner = GridSearch(GridSearchSpace({'x': [1, 2]}), 3, 'val_acc')\n")
    (tmp_path / "afile").write_text("")
    for flags, needle in [
        (["--out", str(tmp_path / "afile")], "is a file"),
        (["--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
        (["--json", str(tmp_path)], "must name a file"),
        (["--no-merge", "--mode", "merged"], "contradicts --mode merged"),
    ]:
        assert main(["simulate", str(study), *flags]) == 2, flags
        err = capsys.readouterr().err
        assert needle in "".join(err.split("\n")) and "Traceback" not in err, (flags, err)
    out = tmp_path / "kept"
    assert main(["simulate", str(study), "--out", str(out), "--mode", "merged"]) == 0
    kept = (out / "merged" / "summary-grid.json").read_bytes()
    capsys.readouterr()
    assert main(["simulate", str(study), "--out", str(out)]) == 2  # its merged run is there: nothing runs
    assert "already holds a simulation" in capsys.readouterr().err
    assert (out / "merged" / "summary-grid.json").read_bytes() == kept and not (out / "trial").exists()
    assert main(["simulate", str(study), "--out", str(out), "--mode", "trial"]) == 0  # the other mode is free


def test_a_simulated_worker_process_does_not_import_torch() -> None:
    """benchmarks/cluster_load.py starts forty of them: the import chain stays torch-free."""
    code = ("import sys, gpu_worker.simulated_worker; "
            "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
            "assert not bad, bad[:3]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(("ramp_first", "p_w", "mixed"), [(False, 700 / 600, 0), (True, 850 / 600, 1)])
def test_the_merge_savings_benchmark_says_when_its_p_w_prices_a_prefix_at_a_node_average(
        ramp_first: bool, p_w: float, mixed: int, tmp_path: Path) -> None:
    """benchmarks/merge_savings.py prices a step at its node's average seconds per step. A trial
    whose batch size quadruples at step 100 (1 s/step, then 4) and one that keeps it: trial-based
    they cost 500 + 200 s, merged 600 s, so p_w is 7/6. When the ramp is submitted first the
    shared node is the ramp's, and the other trial's prefix [0, 100) is priced at the node's
    average (2.5 s/step): the benchmark then counts that node as mixed, so p_w is flagged as
    approximate."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("merge_savings", ROOT / "benchmarks" / "merge_savings.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    trainer = SimulatedTrainer("pw", ("lr", "batch_size"),
                               cost=CostModel(base_seconds=1.0, scale={"batch_size": (128, 1.0)}), curve=CurveModel())
    ramp = {"lr": Constant(0.1), "batch_size": Piecewise([Constant(128), Constant(512)], [100])}
    flat = {"lr": Constant(0.1), "batch_size": Constant(128)}
    space = [ramp, flat] if ramp_first else [flat, ramp]
    simulate(trainer, [SimStudy("pw", GridSearch(space, 200, "val_acc"))], workers=1, run_dir=tmp_path)
    store = ProjectionStore(tmp_path / "state")
    try:
        pw = bench.cost_weighted_merge_rate(store.load())
    finally:
        store.close()
    assert (pw["p_w"], pw["mixed_cost_nodes"]) == (pytest.approx(p_w), mixed)

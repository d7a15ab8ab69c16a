"""OptunaSearch with a persistent Optuna storage in real ``stagetree run``s (the digits CNN, a
few steps): a storage on the run's own directory is refused before it can cost the run its log,
a bad storage URL is bad input, ``--resume`` decides as the first run did (and as ``replay
verify`` recomputes) whatever the storage already holds, and ``stagetree simulate`` leaves the
storage alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

optuna = pytest.importorskip("optuna", reason="the Optuna searcher needs `pip install 'stagetree[optuna]'`")

from events import topics  # noqa: E402
from events.log import EmbeddedLog  # noqa: E402
from projections.summary import summary_path  # noqa: E402
from stagetree.cli import main  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STUDY = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
import optuna
from digits import DigitsTrainer
from stagetree.integration.optuna import OptunaSearch, journal_storage
from stagetree.spaces import Choice, LogUniform

name = "opt"
seed = 7
trainer = DigitsTrainer()
tuner = OptunaSearch({{"lr": LogUniform(0.01, 0.3), "batch_size": 32, "momentum": Choice([0.0, 0.9])}},
                     "val_acc", n_trials=4, batch=1, steps=3, seed=3,
                     sampler=optuna.samplers.TPESampler(seed=3, n_startup_trials=2), storage=STORAGE)
"""


def study_file(tmp_path: Path, storage: str) -> Path:
    path = tmp_path / "study.py"
    path.write_text(STUDY.replace("STORAGE)", f"{storage})"))
    return path


def run(path: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(path), "--workers", "1", "--out", str(out),
                           "--quiet", *flags], capture_output=True, text=True, timeout=600)


def test_a_journal_on_the_runs_own_directory_is_refused_before_the_run(tmp_path: Path) -> None:
    """The study file's storage owned ``--out``'s log in the ``stagetree run`` process itself:
    the run's coordinator then opened it again, and the journal's handle won at exit, leaving a
    log with the Optuna stream and no plan stream, after a run that said it succeeded."""
    out = tmp_path / "out"
    path = study_file(tmp_path, f"journal_storage({str(out)!r}, timeout_s=3)")
    proc = run(path, out)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "opens the log of --out" in err and "another directory" in err, err
    with EmbeddedLog(out / "log", read_only=True) as log:
        assert log.end_offset(topics.PLAN) == 0


@pytest.mark.parametrize(("storage", "needle"), [
    ("'not-a-url'", "`storage` is 'not-a-url', but is not a database URL"),
    ("'sqlite:////nonexistent-dir/x/o.db'", "its SQLite file's directory '/nonexistent-dir/x' does not exist"),
])
def test_a_bad_storage_is_bad_input_before_anything_is_created(tmp_path: Path, storage: str, needle: str) -> None:
    proc = run(study_file(tmp_path, storage), tmp_path / "out")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and needle in err and "Traceback" not in err, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists()


def test_resume_decides_as_the_first_run_whatever_the_storage_holds(tmp_path: Path, capsys) -> None:
    """A run cut after its second trial (its log's head, as a kill leaves it) resumed against a
    storage that holds the whole first run's trials: the tuner asked that Optuna study, which
    proposed other configurations than the first run had, so the resumed study answered other
    trials and failed ``replay verify``. It decides in memory now, as verify recomputes."""
    db = tmp_path / "o.db"
    path = study_file(tmp_path, f"'sqlite:///{db}'")
    first = tmp_path / "first"
    assert run(path, first).returncode == 0
    summary = orjson.loads((first / "summary.json").read_bytes())
    stored = optuna.load_study(study_name="opt", storage=f"sqlite:///{db}").trials
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in stored) == 4  # (duplicates are told FAIL)
    # the first run's log up to its third draw (TPE's first from its model), dispatch copies and checkpoints alike
    cut = tmp_path / "cut"
    shutil.copytree(first / "checkpoints", cut / "checkpoints")
    with EmbeddedLog(first / "log", read_only=True) as log:
        plan = list(log.read(topics.PLAN))
        dispatch = list(log.read(topics.DISPATCH))
    draws = [r.offset for r in plan if b'"TunerDecided"' in r.value and b'"kind":"draw"' in r.value]
    head = plan[:draws[2]]
    copies = {r.value for r in head}
    with EmbeddedLog(cut / "log") as log:
        log.append_many(topics.PLAN, [(r.key, r.value) for r in head])
        log.append_many(topics.DISPATCH, [(r.key, r.value) for r in dispatch if r.value in copies])
    proc = run(path, cut, "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "its Optuna study is kept in memory for this run" in " ".join(proc.stderr.split())
    resumed = orjson.loads((cut / "summary.json").read_bytes())
    assert [t["trial_id"] for t in resumed["trials"]] == [t["trial_id"] for t in summary["trials"]]
    assert resumed["best_trial"] == summary["best_trial"]
    assert main(["replay", "verify", str(cut), "--quiet"]) == 0, capsys.readouterr().out
    assert len(optuna.load_study(study_name="opt", storage=f"sqlite:///{db}").trials) == len(stored)  # left alone


def test_simulate_leaves_the_storage_alone_and_both_modes_draw_alike(tmp_path: Path, capsys) -> None:
    """Both modes of ``stagetree simulate`` asked one Optuna study in the user's storage: the
    second saw the first's made-up results and drew other trials (the ratios compared different
    studies), and the storage kept them for a later real run to learn from."""
    db = tmp_path / "o.db"
    path = study_file(tmp_path, f"'sqlite:///{db}'")
    assert main(["simulate", str(path), "--workers", "1", "--out", str(tmp_path / "sim")]) == 0
    runs = {m: orjson.loads(summary_path(tmp_path / "sim" / m, "opt").read_bytes()) for m in ("merged", "trial")}
    assert [t["trial_id"] for t in runs["merged"]["trials"]] == [t["trial_id"] for t in runs["trial"]["trials"]]
    assert runs["merged"]["total_steps"] == runs["trial"]["total_steps"]
    assert not db.exists() or not optuna.get_all_study_summaries(storage=f"sqlite:///{db}")


def test_the_optuna_study_lives_in_a_stagetree_log_of_its_own(tmp_path: Path) -> None:
    """The journal storage of stagetree.integration.optuna, in a directory beside the run's:
    the searcher's Optuna study is written there and read back by another storage object, each
    trial with the value the run's summary gives it. (The simulator writes no storage.)"""
    from stagetree.integration.optuna import journal_storage

    journal = tmp_path / "optuna"
    assert run(study_file(tmp_path, f"journal_storage({str(journal)!r})"), tmp_path / "out").returncode == 0
    summary = orjson.loads((tmp_path / "out" / "summary.json").read_bytes())
    again = optuna.load_study(study_name="opt", storage=journal_storage(journal))
    done = [t for t in again.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert {t.user_attrs["stagetree_trial"]: t.value for t in done} == \
        {t["trial_id"]: t["metrics"]["val_acc"] for t in summary["trials"]}

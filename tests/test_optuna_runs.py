"""OptunaSearch with a persistent Optuna storage in real ``stagetree run``s (the digits CNN, a
few steps): a storage on the run's own directory is refused before it can cost the run its log,
a bad storage URL is bad input, ``--resume`` decides as the first run did (and as ``replay
verify`` recomputes) whatever the storage already holds and then brings a killed run's Optuna
study up to date, and ``stagetree simulate`` leaves the storage alone."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

optuna = pytest.importorskip("optuna", reason="the Optuna searcher needs `pip install 'stagetree[optuna]'`")

from optuna.trial import TrialState  # noqa: E402

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
    assert "its Optuna study is kept in memory for this run, and the one in `storage` is brought up to date" in \
        " ".join(proc.stderr.split())
    resumed = orjson.loads((cut / "summary.json").read_bytes())
    assert [t["trial_id"] for t in resumed["trials"]] == [t["trial_id"] for t in summary["trials"]]
    assert resumed["best_trial"] == summary["best_trial"]
    assert main(["replay", "verify", str(cut), "--quiet"]) == 0, capsys.readouterr().out
    assert len(optuna.load_study(study_name="opt", storage=f"sqlite:///{db}").trials) == len(stored)  # left alone


HELD = """
import os, time
from pathlib import Path

class Held(DigitsTrainer):
    \"\"\"Holds its worker in the third trial's first step when STAGETREE_TEST_HOLD names a file
    (one worker trains the trials one after another): it writes the file and waits to be killed.\"\"\"
    seen = []

    def setup(self, hp):
        if hp not in Held.seen:
            Held.seen.append(dict(hp))
        super().setup(hp)

    def train_step(self, indices, step):
        hold = os.environ.get("STAGETREE_TEST_HOLD")
        if hold and len(Held.seen) >= 3:
            Path(hold).write_text("held")
            time.sleep(600)
        super().train_step(indices, step)

trainer = Held()
"""


def stored_trials(db: Path) -> list[tuple]:
    return [(t.number, t.state, t.params, t.values, t.intermediate_values, t.user_attrs)
            for t in optuna.load_study(study_name="opt", storage=f"sqlite:///{db}").trials]


def killed_run(tmp_path: Path, db: Path) -> tuple[Path, Path]:
    """The study of :data:`HELD` with its storage in ``db``, killed (-9, its workers too) while
    its third trial trains; returns its study file and ``--out``."""
    path = tmp_path / "cut.py"
    path.write_text(STUDY.replace("STORAGE)", f"'sqlite:///{db}')") + HELD)
    out, held = tmp_path / "out", tmp_path / "held"
    proc = subprocess.Popen([sys.executable, "-m", "stagetree.cli", "run", str(path), "--workers", "1", "--out",
                             str(out), "--quiet"], env={**os.environ, "STAGETREE_TEST_HOLD": str(held)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert held.exists(), f"the run never reached its third trial (exit {proc.poll()})"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    return path, out


def test_a_killed_runs_optuna_study_is_brought_up_to_date_by_its_resume(tmp_path: Path) -> None:
    """kill -9 of a run while its third trial trains left that Optuna trial RUNNING in the
    user's storage for ever, and the trials the resumed run asked only in memory: the storage
    (what optuna-dashboard shows) never held the study's outcome. The resume now finishes the
    trial the kill left open and adds the rest, so the storage holds what an uninterrupted run's
    does: the same trials, states, values and reports, numbered alike."""
    whole_db, cut_db = tmp_path / "whole.db", tmp_path / "cut.db"
    whole = study_file(tmp_path, f"'sqlite:///{whole_db}'")
    whole.write_text(whole.read_text() + HELD)
    assert run(whole, tmp_path / "whole").returncode == 0
    cut, out = killed_run(tmp_path, cut_db)
    states = [t[1] for t in stored_trials(cut_db) if "duplicate_of" not in t[5]]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.RUNNING], states
    resumed = run(cut, out, "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert stored_trials(cut_db) == stored_trials(whole_db)
    assert sum(t[1] == TrialState.COMPLETE for t in stored_trials(cut_db)) == 4


def test_a_storage_holding_another_study_of_the_name_is_left_alone_by_a_resume(tmp_path: Path) -> None:
    """The same name in the storage, other trials (another study's): the resume warns, naming
    both parameters, and writes nothing there."""
    db = tmp_path / "cut.db"
    cut, out = killed_run(tmp_path, db)
    db.unlink()
    other = optuna.create_study(study_name="opt", storage=f"sqlite:///{db}", direction="maximize")
    other.add_trial(optuna.trial.create_trial(params={"lr": 0.5}, value=0.25,
                                              distributions={"lr": optuna.distributions.FloatDistribution(0.1, 1.0)}))
    before = stored_trials(db)
    resumed = run(cut, out, "--resume")
    err = " ".join(resumed.stderr.split())
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "RuntimeWarning: the Optuna study 'opt' in `storage` was not brought up to date: its trial 0 has the " \
           "parameters {'lr': 0.5}" in err, err
    assert stored_trials(db) == before


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

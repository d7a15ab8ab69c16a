"""Experiment-tracker exports (``stagetree export tensorboard|mlflow``) of a real run: the WSD
example at its test size, merged and ``--no-merge`` (conftest ``wsd_runs``).

Read back with TensorBoard's own event reader and the MLflow client: the exact metrics of
``summary.json`` at every trial's final step, every evaluated step of its path (each equal, bit
for bit, to what the ``--no-merge`` run measured for a trial with the same prefix), its
hyper-parameters, and the stages it shares, checked against the first step where the
hyper-parameter sequences of two trials differ.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from events.hp import config_from_json, first_divergence
from projections.state import State
from replay.audit import fold, open_source
from stagetree.cli import main
from stagetree.export.run import RunReadError, RunView, flat_hp, read_run

REPO = Path(__file__).resolve().parents[1]


def _summary(run: Path) -> dict:
    return orjson.loads((run / "summary.json").read_bytes())


def _state(run: Path) -> State:
    return fold(open_source(run).streams["stagetree.plan"])


@pytest.fixture(scope="module")
def merged(wsd_runs: dict[str, Path]) -> RunView:
    return read_run(wsd_runs["merged"])


# ----------------------------------------------------------------------------- the reader


def test_the_reader_gives_summary_metrics_and_every_evaluated_step(merged: RunView, wsd_runs: dict[str, Path]) -> None:
    summary = _summary(wsd_runs["merged"])
    assert merged.study_id == summary["name"] == "wsd-test" and merged.metric == "val_loss"
    assert {t.trial_id for t in merged.trials} == {t["trial_id"] for t in summary["trials"]}
    by_id = {t.trial_id: t for t in merged.trials}
    for row in summary["trials"]:
        trial = by_id[row["trial_id"]]
        assert trial.final == row["metrics"] and trial.metrics[row["steps"]] == row["metrics"]
        assert trial.hp == row["hp"]
    # A trial that branches off late also shows the trunk's evaluations that others asked for:
    # each equals, bit for bit, what the --no-merge run measured for a trial with that prefix.
    independent = _state(wsd_runs["trial"])
    extra = 0
    for trial in merged.trials:
        hp = config_from_json(trial.hp)
        for step, metrics in trial.metrics.items():
            same_prefix = [t for t in independent.trials.values() if step in t.results
                           and first_divergence(hp, t.hp, 0, step) == step]
            assert same_prefix, (trial.trial_id, step)
            assert all(t.results[step] == metrics for t in same_prefix), (trial.trial_id, step)
            extra += step not in (trial.steps,)
    assert extra > 0  # the example's late cooldowns see the constant schedule's evaluations


def test_shared_stages_are_the_prefixes_where_schedules_agree(merged: RunView) -> None:
    """Two trials of a merged plan share exactly the steps before the first step where their
    sequences differ (up to the shorter trial), Hippo §3.2; the reader's shared stages agree."""
    by_id = {t.trial_id: t for t in merged.trials}
    for a in merged.trials:
        for b in merged.trials:
            if a is b:
                continue
            limit = min(a.steps, b.steps)
            expected = first_divergence(config_from_json(a.hp), config_from_json(b.hp), 0, limit)
            shared = sum(s.to_step - s.from_step for s in a.shared if b.trial_id in s.trials)
            assert shared == expected, (a.trial_id, b.trial_id)
        assert a.shared_steps == max((sum(s.to_step - s.from_step for s in a.shared if o in s.trials)
                                      for o in by_id if o != a.trial_id), default=0) or a.shared
    assert all(t.shared for t in merged.trials)  # every WSD schedule shares its warm-up


def test_no_merge_runs_share_nothing_and_unknown_studies_are_named(wsd_runs: dict[str, Path]) -> None:
    view = read_run(wsd_runs["trial"])
    assert view.mode == "trial" and not any(t.shared for t in view.trials)
    with pytest.raises(RunReadError, match=r"study 'nope' has no trials .* \(studies: \['wsd-test'\]\)"):
        read_run(wsd_runs["trial"], "nope")
    with pytest.raises(RunReadError, match="does not exist"):
        read_run(wsd_runs["trial"] / "missing")


def test_flat_hp_names_each_number_of_a_sequence() -> None:
    warmup = {"kind": "Warmup", "init": 0.0, "period": 5, "then": {"kind": "Constant", "value": 0.003}}
    cooldown = {"kind": "PowerRamp", "init": 0.003, "end_value": 0.0, "period": 8, "power": 0.5}
    hp = {"lr": {"kind": "Piecewise", "boundaries": [40], "functions": [warmup, cooldown]}}
    flat = flat_hp(hp)
    assert flat["lr"].startswith("Piecewise(functions=[Warmup(init=0.0, period=5")
    assert flat["lr.boundaries"] == "[40]" and flat["lr.functions.1.power"] == 0.5
    assert flat["lr.functions.0.then.value"] == 0.003 and flat["lr.functions.1.kind"] == "PowerRamp"


# ----------------------------------------------------------------------------- TensorBoard


def _tensorboard(run_dir: Path) -> dict[str, dict]:
    """Every run under ``run_dir`` read with TensorBoard's event reader: run -> {"scalars":
    {tag: {step: value}}, "hparams": {tag: HParamsPluginData}}."""
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    out = {}
    for directory in [run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())]:
        acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.TENSORS: 0})
        acc.Reload()
        hparams = {tag: plugin_data_pb2.HParamsPluginData.FromString(content)
                   for tag, content in acc.PluginTagToContent("hparams").items()}
        scalars = {tag: {e.step: tensor_util.make_ndarray(e.tensor_proto).item() for e in acc.Tensors(tag)}
                   for tag in acc.Tags()["tensors"] if not tag.startswith("_hparams_/")}
        out["." if directory == run_dir else directory.name] = {"scalars": scalars, "hparams": hparams}
    return out


def test_tensorboard_export_reads_back_exactly(merged: RunView, wsd_runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "tb"
    for _ in range(2):  # exporting again replaces the first export's files
        assert main(["export", "tensorboard", str(wsd_runs["merged"]), "--out", str(out)]) == 0
        # a run an export of another study left (its trial is not in this one), and a user's own
        (out / "0123456789abcdef").mkdir(exist_ok=True)
        (out / "0123456789abcdef" / "events.out.tfevents.1.host.stagetree").write_bytes(b"")
        (out / "mine").mkdir(exist_ok=True)
        (out / "mine" / "events.out.tfevents.1.host").write_bytes(b"")
    assert main(["export", "tensorboard", str(wsd_runs["merged"]), "--out", str(out)]) == 0
    assert not (out / "0123456789abcdef").exists() and (out / "mine" / "events.out.tfevents.1.host").is_file()
    shutil.rmtree(out / "mine")
    runs = _tensorboard(out)
    summary = _summary(wsd_runs["merged"])
    assert set(runs) == {".", *(t["trial_id"] for t in summary["trials"])}
    assert all(len(list((out / t["trial_id"]).glob("events.out.tfevents.*"))) == 1 for t in summary["trials"])
    for row in summary["trials"]:
        run = runs[row["trial_id"]]
        for name, value in row["metrics"].items():
            assert run["scalars"][name][row["steps"]] == value  # float64: exact
    for trial in merged.trials:
        run = runs[trial.trial_id]
        for name in ("val_loss", "val_bpc"):
            assert run["scalars"][name] == {s: m[name] for s, m in trial.metrics.items()}
        start = run["hparams"]["_hparams_/session_start_info"].session_start_info
        got = {k: (v.number_value if v.WhichOneof("kind") == "number_value" else v.string_value)
               for k, v in start.hparams.items()}
        assert got == flat_hp(trial.hp) and start.group_name == trial.trial_id
        assert run["hparams"]["_hparams_/session_end_info"].session_end_info.status == 1  # STATUS_SUCCESS
    experiment = runs["."]["hparams"]["_hparams_/experiment"].experiment
    assert {m.name.tag for m in experiment.metric_infos} == {"val_loss", "val_bpc"}
    assert {h.name for h in experiment.hparam_infos} == {k for t in merged.trials for k in flat_hp(t.hp)}


# ----------------------------------------------------------------------------- MLflow


def test_mlflow_export_reads_back_exactly(merged: RunView, wsd_runs: dict[str, Path], tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export", "mlflow", str(wsd_runs["merged"]), "--tracking-uri", uri]) == 0
    assert main(["export", "mlflow", str(wsd_runs["merged"]), "--tracking-uri", uri]) == 0  # replaces
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("wsd-test")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    summary = _summary(wsd_runs["merged"])
    # the experiment keeps the log's anchor apart from the log, and the tuner the study recorded
    assert experiment.tags["stagetree.log_anchor"] == summary["log_anchor"] == merged.anchor
    assert experiment.tags["stagetree.tuner"].startswith('EvaluateAt(metric="val_loss", mode="min", ')
    assert set(runs) == {t["trial_id"] for t in summary["trials"]}
    for row in summary["trials"]:
        run = runs[row["trial_id"]]
        assert run.info.status == "FINISHED"
        for name, value in row["metrics"].items():
            history = client.get_metric_history(run.info.run_id, name)
            assert {m.step: m.value for m in history}[row["steps"]] == value
    for trial in merged.trials:
        run = runs[trial.trial_id]
        for name in ("val_loss", "val_bpc"):
            history = client.get_metric_history(run.info.run_id, name)
            assert {m.step: m.value for m in history} == {s: m[name] for s, m in trial.metrics.items()}
        assert run.data.params == {k: str(v) for k, v in flat_hp(trial.hp).items()}
        tags = run.data.tags
        assert tags["stagetree.trial_id"] == trial.trial_id and tags["stagetree.study"] == "wsd-test"
        assert tags["stagetree.shared_steps"] == str(trial.shared_steps)
        others = sorted({o for s in trial.shared for o in s.trials})
        assert tags["stagetree.shared_with"] == ",".join(others)
        for s in trial.shared:
            assert tags[f"stagetree.shared.{s.node_id}.{s.from_step}-{s.to_step}"] == ",".join(s.trials)
        assert tags["stagetree.path"] == " ".join(f"{n}[{a},{b})" for _, n, a, b in trial.path)


# ----------------------------------------------------------------------------- the command


def test_bad_source_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "tensorboard", str(tmp_path / "missing"), "--out", str(tmp_path / "tb")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("tracker", ["tensorboard", "mlflow"])
def test_a_missing_tracker_names_the_extra(tracker: str, wsd_runs: dict[str, Path], tmp_path: Path) -> None:
    args = ["export", tracker, str(wsd_runs["merged"])]
    args += ["--out", str(tmp_path / "tb")] if tracker == "tensorboard" else ["--tracking-uri", f"sqlite:///{tmp_path}/m.db"]
    code = f"import sys; sys.modules[{tracker!r}] = None\nfrom stagetree.cli import main\nsys.exit(main({args!r}))\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pip install 'stagetree[{tracker}]'" in proc.stderr
    assert not (tmp_path / "tb").exists() and not (tmp_path / "m.db").exists()


def test_a_tracking_store_mlflow_refuses_is_a_one_line_error(wsd_runs: dict[str, Path], tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """MLflow 3 refuses a file store without MLFLOW_ALLOW_FILE_STORE: exit 2 naming the URI and
    MLflow's reason (was an MlflowException's traceback, exit 1)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = f"file://{tmp_path}/mlruns"
    assert main(["export", "mlflow", str(wsd_runs["merged"]), "--tracking-uri", uri]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--tracking-uri {uri}: MLflow refused the export:" in err and "MLFLOW_ALLOW_FILE_STORE" in err, err


def test_a_failed_trial_tells_the_tracker_why(tmp_path: Path) -> None:
    """A failed trial's MLflow run says why it failed (``stagetree.error``), as its summary does."""
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(REPO / "tests" / "studies" / "failing.py"),
                           "--workers", "1", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # some trial failed
    failed = [t for t in _summary(out)["trials"] if t["status"] == "failed"]
    assert failed and "loss diverged at step 12" in failed[0]["error"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["export", "mlflow", str(out), "--tracking-uri", uri]) == 0
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(_summary(out)["name"])
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    run = runs[failed[0]["trial_id"]]
    assert run.info.status == "FAILED" and run.data.tags["stagetree.error"] == failed[0]["error"]
    assert all("stagetree.error" not in r.data.tags for name, r in runs.items() if name != failed[0]["trial_id"])


def test_every_commands_help_gives_a_kafka_source_as_the_readme_does() -> None:
    """``export tensorboard|mlflow --help`` said ``kafka://HOST:PORT[/TOPIC]`` where the README
    and the other commands say ``[/PREFIX]`` (the path is a topic prefix, or the plan topic)."""
    import argparse

    from stagetree.cli import parser

    helps: dict[str, str] = {}

    def walk(p: argparse.ArgumentParser, name: str) -> None:
        helps[name] = p.format_help()
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, child in action.choices.items():
                    walk(child, f"{name} {sub}")

    walk(parser(), "stagetree")
    assert not [name for name, text in helps.items() if "[/TOPIC]" in text]
    for name in ("stagetree export tensorboard", "stagetree export mlflow"):
        assert "kafka://HOST:PORT[/PREFIX]" in " ".join(helps[name].split()), helps[name]

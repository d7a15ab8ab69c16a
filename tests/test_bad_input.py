"""Bad input gets a clear error naming the field and the value, and loses nothing already
recorded (DESIGN.md "Standards for the code").

The SDK half drives a real :class:`~stagetree.study.Study` over a small runtime that does what
the embedded coordinator does with the log: encode events onto the plan stream of a real
EmbeddedLog and fold them with the real Projector into a real ProjectionStore. The CLI half
calls ``stagetree.cli.main`` with bad files and flags; none of those may start a worker.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from events import topics
from events.hp import Constant, Cosine, MultiStep, Warmup
from events.log import EmbeddedLog, append_events
from events.models import Event
from gpu_worker.trainer import Trainer
from projections.state import State
from projections.store import ProjectionStore, Projector, snapshot
from projections.summary import summary_path
from stagetree.cli import main
from stagetree.study import Study

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


class TinyTrainer(Trainer):
    """A trainer the Study only inspects (names, fingerprint); it is never trained here."""

    hyperparameters = ("lr", "momentum")

    def build(self, seed: int, device: torch.device) -> None:
        self.model = torch.nn.Linear(1, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train_size(self) -> int:
        return 1

    def setup(self, hp: dict[str, float | int]) -> None:
        pass

    def train_step(self, indices: torch.Tensor, step: int) -> None:
        pass

    def evaluate(self) -> dict[str, float]:
        return {}


class LogRuntime:
    """The Runtime protocol over a real log: append = encode + append + fold; watch = a future."""

    def __init__(self, path: Path) -> None:
        self.log = EmbeddedLog(path / "log")
        self.store = ProjectionStore(path / "state")
        self.projector = Projector(self.log, store=self.store)
        self.watched: list[tuple[str, int]] = []

    @property
    def state(self) -> State:
        return self.projector.state

    def append(self, events: list[Event]) -> None:
        append_events(self.log, topics.PLAN, [(getattr(e, "plan_key", "") or "", e) for e in events])
        self.projector.catch_up()

    def watch(self, trial_id: str, steps: int) -> asyncio.Future[dict[str, float]]:
        self.watched.append((trial_id, steps))
        return asyncio.get_running_loop().create_future()

    def close(self) -> None:
        self.log.close()
        self.store.close()


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[LogRuntime]:
    rt = LogRuntime(tmp_path)
    yield rt
    rt.close()


GOOD = {"lr": MultiStep(0.1, (100, 200), 0.1), "momentum": 0.9}


@pytest.fixture
def study(runtime: LogRuntime) -> Study:
    """A study with one valid trial already recorded."""
    study = Study(runtime, "s", TinyTrainer(), seed=3)

    async def record() -> None:
        study.submit(GOOD, 100)
        await asyncio.sleep(0)  # the batch is appended at the end of this loop turn

    asyncio.run(record())
    assert runtime.log.end_offset(topics.PLAN) == 1
    assert len(runtime.state.trials) == 1
    return study


def check_rejected(study: Study, runtime: LogRuntime, call: Callable[[Study], Any], *needles: str) -> str:
    """Run ``call`` inside an event loop; it must raise ValueError whose message contains every
    needle, and nothing may reach the log or the projection."""
    end = runtime.log.end_offset(topics.PLAN)
    records = list(runtime.log.read(topics.PLAN))
    stored = runtime.store.records()
    state = snapshot(runtime.state)
    watched = list(runtime.watched)

    async def attempt() -> str:
        with pytest.raises(ValueError) as info:
            result = call(study)
            if asyncio.iscoroutine(result):
                await result
        await asyncio.sleep(0)  # let any (wrongly) scheduled flush run
        await asyncio.sleep(0)
        return str(info.value)

    message = asyncio.run(attempt())
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    assert runtime.log.end_offset(topics.PLAN) == end
    assert list(runtime.log.read(topics.PLAN)) == records
    assert runtime.log.end_offset(topics.DEADLETTER) == 0
    assert runtime.store.records() == stored
    assert snapshot(runtime.state) == state
    assert runtime.watched == watched  # no future was handed out for a rejected request
    return message


# ============================================================================ Study.config / submit


def test_unknown_hyperparameter(study: Study, runtime: LogRuntime) -> None:
    check_rejected(study, runtime, lambda s: s.submit({**GOOD, "dropout": 0.5}, 100), "'dropout'", "TinyTrainer")
    check_rejected(study, runtime, lambda s: s.config({**GOOD, "dropout": 0.5}), "'dropout'")


def test_missing_hyperparameter(study: Study, runtime: LogRuntime) -> None:
    msg = check_rejected(study, runtime, lambda s: s.submit({"lr": 0.1}, 100), "'momentum'")
    assert "0.1" in msg  # shows the config it was given
    check_rejected(study, runtime, lambda s: s.submit({}, 100), "'lr'")


@pytest.mark.parametrize("steps", [0, -5, 2.5, True, False, "10", None, 10.0])
def test_bad_steps(study: Study, runtime: LogRuntime, steps: object) -> None:
    check_rejected(study, runtime, lambda s: s.submit(GOOD, steps), "`steps`", repr(steps))


@pytest.mark.parametrize("step", [0, -1, 1.5, True])
def test_bad_eval_step(study: Study, runtime: LogRuntime, step: object) -> None:
    check_rejected(study, runtime, lambda s: s.eval(GOOD, step), "`steps`", repr(step))


def test_a_value_that_cannot_be_computed_is_refused_in_plain_words(study: Study, runtime: LogRuntime) -> None:
    """The refusal came wrapped in pydantic's text (its title, the whole input, a URL), and the
    submit had already handed out a future that never resolved."""
    from events.hp import Exponential

    msg = check_rejected(study, runtime, lambda s: s.submit({**GOOD, "lr": Exponential(1.0, 2.0)}, 2000),
                         "'lr'", "1024")
    assert "validation error" not in msg and "pydantic" not in msg and "\n" not in msg, msg


def test_steps_beyond_64_bits_are_rejected_at_submit(study: Study, runtime: LogRuntime) -> None:
    """``steps`` travels as a JSON integer, which orjson limits to 64 bits: a larger value must
    be refused by ``submit`` with a ValueError naming ``steps``, not fail later inside the loop
    callback that appends the batch (where it is lost and the future never resolves)."""
    check_rejected(study, runtime, lambda s: s.submit(GOOD, 2**64), "steps", str(2**64))


@pytest.mark.parametrize(
    ("lr", "needles"),
    [
        ({"kind": "MultiStep", "init": 0.1, "milestones": [200, 100], "gamma": 0.1}, ["milestones", "[200, 100]"]),
        ({"kind": "MultiStep", "init": 0.1, "milestones": [100, 100], "gamma": 0.1}, ["milestones", "[100, 100]"]),
        ({"kind": "MultiStep", "init": 0.1, "milestones": [0], "gamma": 0.1}, ["milestones", "[0]"]),
        ({"kind": "MultiStep", "init": 0.1, "milestones": [100], "gamma": -2}, ["gamma", "-2"]),
        ({"kind": "Cosine", "init": 0.1, "min_value": 0.0, "period": 50, "gamma": 0.5}, ["gamma", "0.5"]),
        ({"kind": "Cosine", "init": 0.1, "min_value": 0.0, "period": 0}, ["period", "0"]),
        ({"kind": "Warmup", "init": 0.0, "period": 0, "then": {"kind": "Constant", "value": 0.1}}, ["period", "0"]),
        ({"kind": "Warmup", "init": 0.0, "period": 10, "then": {"kind": "Constant", "value": "x"}}, ["value", "'x'"]),
        ({"kind": "Exponential", "init": 0.1, "gamma": 0}, ["gamma", "0"]),
        ({"kind": "Constant", "value": float("inf")}, ["value", "inf", "finite"]),
        ({"kind": "StepLR", "gamma": 0.1}, ["StepLR"]),
        (True, ["True"]),
        ("0.1", ["'0.1'"]),
        (None, ["None"]),
        (float("nan"), ["nan", "finite"]),
        (2**70, ["value", str(2**70)]),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_invalid_function(study: Study, runtime: LogRuntime, lr: object, needles: list[str]) -> None:
    msg = check_rejected(study, runtime, lambda s: s.submit({"lr": lr, "momentum": 0.9}, 100), "'lr'", *needles)
    assert msg.startswith("hyper-parameter 'lr'")


@pytest.mark.parametrize(
    ("make", "needles"),
    [
        (lambda: MultiStep(0.1, (200, 100), 0.1), ["milestones", "[200, 100]"]),
        (lambda: Cosine(0.1, 0.0, 50, gamma=0.9), ["gamma", "0.9"]),
        (lambda: Warmup(0.0, 0, Constant(0.1)), ["period", "0"]),
        (lambda: Constant(True), ["value", "True"]),
        # lengths beyond 64 bits were accepted, then failed the trial id's JSON: a bare TypeError
        (lambda: MultiStep(0.1, (2**64,), 0.1), ["milestones", str(2**64), "64 bits"]),
        (lambda: Cosine(0.1, 0.0, 2**70), ["period", str(2**70), "64 bits"]),
        (lambda: Warmup(0.0, 2**64, Constant(0.1)), ["period", str(2**64), "64 bits"]),
    ],
)
def test_invalid_function_objects(make: Callable[[], object], needles: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        make()
    for needle in needles:
        assert needle in str(info.value)


def test_hp_not_a_mapping(study: Study, runtime: LogRuntime) -> None:
    check_rejected(study, runtime, lambda s: s.submit([("lr", 0.1), ("momentum", 0.9)], 100), "`hp`", "'lr'")


def test_cancel_unknown_trial(study: Study, runtime: LogRuntime) -> None:
    check_rejected(study, runtime, lambda s: s.cancel({"lr": 0.5, "momentum": 0.9}), "`hp`", "0.5", "'s'")
    check_rejected(study, runtime, lambda s: s.cancel({"lr": 0.5}), "'momentum'")


def test_valid_requests_still_work_after_errors(study: Study, runtime: LogRuntime) -> None:
    check_rejected(study, runtime, lambda s: s.submit(GOOD, 0), "`steps`")

    async def more() -> None:
        study.submit(GOOD, 200)  # a promotion of the recorded trial
        study.submit({"lr": 0.05, "momentum": 0.0}, 50)
        await asyncio.sleep(0)
        study.cancel({"lr": 0.05, "momentum": 0.0})
        await asyncio.sleep(0)

    asyncio.run(more())
    assert runtime.log.end_offset(topics.PLAN) == 4
    assert runtime.state.rejected == {}
    assert sorted(t.status for t in runtime.state.trials.values()) == ["cancelled", "pending"]


def test_cancel_right_after_submit_in_the_same_loop_turn(study: Study, runtime: LogRuntime) -> None:
    """``submit`` accepted the trial (its TrialSubmitted is batched for the end of the loop
    turn); cancelling it in the same turn is valid input and must not be refused as "names no
    submitted trial" just because the batch has not been appended yet."""
    hp = {"lr": 0.05, "momentum": 0.0}

    async def submit_then_cancel() -> None:
        study.submit(hp, 50)
        study.cancel(hp)
        await asyncio.sleep(0)

    asyncio.run(submit_then_cancel())
    assert runtime.state.trials[study.trial_id(study.config(hp))].status == "cancelled"
    assert runtime.state.rejected == {}


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"name": ""}, ["`name`", "''"]),
        ({"seed": -1}, ["`seed`", "-1"]),
        ({"seed": True}, ["`seed`", "True"]),
        ({"seed": 2**63}, ["`seed`", str(2**63)]),
        ({"seed": 1.0}, ["`seed`", "1.0"]),
    ],
)
def test_bad_study_arguments(runtime: LogRuntime, kwargs: dict, needles: list[str]) -> None:
    args = {"name": "s", "seed": 0} | kwargs
    with pytest.raises(ValueError) as info:
        Study(runtime, args["name"], TinyTrainer(), args["seed"])
    for needle in needles:
        assert needle in str(info.value)
    assert runtime.log.end_offset(topics.PLAN) == 0


# ============================================================================ the CLI


def cli(argv: list[str]) -> int:
    """``main(argv)``'s exit code; argparse reports bad flags by raising SystemExit(2)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert multiprocessing.active_children() == []  # no worker was started
    return code


def squash(text: str) -> str:
    """Rich wraps long lines; compare without whitespace."""
    return "".join(text.split())


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


PREAMBLE = f"""
import sys
sys.path.insert(0, {str(EXAMPLES)!r})
from digits import DigitsTrainer
from stagetree.tuners import GridSearch, GridSearchSpace
"""

VALID = PREAMBLE + """
trainer = DigitsTrainer()
tuner = GridSearch(GridSearchSpace({"lr": [0.1], "batch_size": [32], "momentum": [0.0]}), steps=1, metric="val_acc")
name = "tiny"
"""


def run_cli(study: Path, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``stagetree run STUDY --out OUT`` with one worker, in a fresh process."""
    return subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(study), "--workers", "1", "--out",
                           str(out), "--quiet", *flags], capture_output=True, text=True, timeout=300)


@pytest.fixture(autouse=True)
def _restore_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # study files insert examples/


def test_cli_missing_study_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.py"
    assert cli(["run", str(missing), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert squash(str(missing)) in err and "doesnotexist" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("filename", ["exp[v2].py", "exp[bold]1.py", "nofile:smile:x.py"])
def test_cli_error_shows_the_value_verbatim(tmp_path: Path, capsys: pytest.CaptureFixture[str], filename: str) -> None:
    """The error names the value as given: square brackets in a path are not console markup, and
    ``:smile:`` is no emoji code (it was shown as an emoji)."""
    missing = tmp_path / filename
    assert cli(["run", str(missing), "--out", str(tmp_path / "out")]) == 2
    assert squash(str(missing)) in squash(capsys.readouterr().err)


def test_cli_error_with_markup_like_text_still_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "raises.py", "raise ValueError('bad slice x[/] in config')\n")
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    assert squash("bad slice x[/] in config") in squash(capsys.readouterr().err)


def test_cli_syntax_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "broken.py", "trainer = (\n")
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert squash(str(path)) in err and "SyntaxError" in err
    assert not (tmp_path / "out").exists()


def test_cli_import_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "raises.py", "raise RuntimeError('dataset not found')\n")
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert "RuntimeError" in err and squash("dataset not found") in err


def test_cli_file_without_tuner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "notuner.py", PREAMBLE + "trainer = DigitsTrainer()\n")
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert "`tuner`" in err and "None" in err and squash(str(path)) in err
    assert not (tmp_path / "out").exists()


def test_cli_tuner_not_a_tuner(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "badtuner.py", PREAMBLE + "trainer = DigitsTrainer()\ntuner = 'sha'\n")
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert "`tuner`" in err and "'sha'" in err


@pytest.mark.parametrize("value", ["42", "object()", "None", "GridSearch"])
def test_cli_trainer_not_a_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str) -> None:
    body = PREAMBLE + f"""
tuner = GridSearch(GridSearchSpace({{"lr": [0.1]}}), steps=1, metric="val_acc")
trainer = {value}
"""
    path = write(tmp_path / "badtrainer.py", body)
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert "`trainer`" in err and "Trainer" in err
    if value == "42":
        assert "got42" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("body", "needles"), [
    ("seed = -1\n", ["`seed`", "-1"]),
    ("seed = 'zero'\n", ["`seed`", "'zero'"]),
    ("name = ''\n", ["`name`", "''"]),
])
def test_cli_bad_seed_or_name(tmp_path: Path, capsys: pytest.CaptureFixture[str], body: str,
                              needles: list[str]) -> None:
    path = write(tmp_path / "badmeta.py", VALID + body)
    assert cli(["run", str(path), "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    for needle in needles:
        assert squash(needle) in err


@pytest.mark.parametrize("workers", ["0", "-1", "two", "1.5"])
def test_cli_bad_workers(tmp_path: Path, capsys: pytest.CaptureFixture[str], workers: str) -> None:
    path = write(tmp_path / "study.py", VALID)
    assert cli(["run", str(path), "--workers", workers, "--out", str(tmp_path / "out")]) == 2
    err = squash(capsys.readouterr().err)
    assert "--workers" in err and workers in err
    assert not (tmp_path / "out").exists()


def test_cli_run_into_existing_out_without_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    # An earlier run left its log behind.
    with EmbeddedLog(out / "log") as log:
        log.append(topics.PLAN, "k", b"earlier run")
    assert cli(["run", str(path), "--out", str(out)]) == 2
    err = squash(capsys.readouterr().err)
    assert "--out" in err and squash(str(out)) in err and "--resume" in err
    # The earlier run is intact and nothing else was created.
    with EmbeddedLog(out / "log") as log:
        assert [r.value for r in log.read(topics.PLAN)] == [b"earlier run"]
        assert log.end_offset(topics.DEADLETTER) == 0
    assert sorted(p.name for p in out.iterdir()) == ["log"]


def test_cli_run_into_a_directory_whose_run_is_still_starting(tmp_path: Path) -> None:
    """A run that has opened its log but not started its study yet (this test holds the log
    open): a second run there is told the log is in use, not to pass --resume."""
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    with EmbeddedLog(out / "log"):
        proc = run_cli(path, out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = squash(proc.stderr)
    assert "openinanotherprocess" in err and "--resume" not in err, err


def test_cli_resume_of_nothing_starts_the_run(tmp_path: Path) -> None:
    """Issue 11 item 11: ``--resume`` where no run exists yet (a run killed before its log had a
    study, or no directory at all) starts the run; without --resume an empty log is refused."""
    path = write(tmp_path / "study.py", VALID)
    for out in (tmp_path / "none", tmp_path / "killed-early"):
        if out.name == "killed-early":
            EmbeddedLog(out / "log").close()  # the log exists, no study ever started in it
            refused = run_cli(path, out)
            assert refused.returncode == 2 and "--resume" in refused.stderr, refused.stderr
        proc = run_cli(path, out, "--resume")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert orjson.loads((out / "summary.json").read_bytes())["name"] == "tiny"


def test_cli_resume_of_a_finished_study_appends_nothing(tmp_path: Path) -> None:
    """``--resume`` of a study that finished ran its tuner again and appended every decision a
    second time (``replay explain`` listed each twice); now it says so and leaves the log."""
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    assert run_cli(path, out).returncode == 0

    def records() -> int:
        log = EmbeddedLog(out / "log", read_only=True)
        try:
            return sum(1 for _ in log.read(topics.PLAN))
        finally:
            log.close()

    before, summary = records(), (out / "summary.json").read_bytes()
    proc = run_cli(path, out, "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "has finished: nothing to resume" in " ".join(proc.stdout.split()), proc.stdout
    assert records() == before and (out / "summary.json").read_bytes() == summary
    (out / "summary-tiny.json").write_text("{not json")  # damaged: computed again from the log
    proc = run_cli(path, out, "--resume")
    assert proc.returncode == 0 and "computed again from the log" in " ".join(proc.stdout.split()), proc.stdout
    again = orjson.loads((out / "summary-tiny.json").read_bytes())
    kept = orjson.loads(summary)
    assert records() == before
    assert {k: again[k] for k in ("trials", "best_trial", "best_metric", "executed_steps")} == \
        {k: kept[k] for k in ("trials", "best_trial", "best_metric", "executed_steps")}


def test_cli_resume_where_the_log_lost_records_its_projection_folded_is_refused(tmp_path: Path) -> None:
    """A log whose tail is gone (damage, a power loss) beside a projection that folded it: the
    resume appended at offsets the projection had folded, so it skipped them and waited for ever
    (or, on a log with damaged metadata, RocksDB dropped its table files and the run overwrote
    the history). It is refused before anything is opened for writing, saying what to do."""
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    assert run_cli(path, out).returncode == 0
    log = EmbeddedLog(out / "log", read_only=True)
    try:
        head = [(r.key, r.value) for r in log.read(topics.PLAN, 0, 10)]
    finally:
        log.close()
    shutil.rmtree(out / "log")
    for name in ("summary.json", "summary-tiny.json"):
        (out / name).unlink()
    cut = EmbeddedLog(out / "log")
    cut.append_many(topics.PLAN, head)  # the same first 10 records, chained alike
    cut.close()
    proc = run_cli(path, out, "--resume")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "holds 10 records" in err and "move state/ away" in err, err
    log = EmbeddedLog(out / "log", read_only=True)
    try:
        assert log.end_offset(topics.PLAN) == 10  # nothing appended
    finally:
        log.close()
    shutil.rmtree(out / "state")  # as the message says: the projection is rebuilt from what log/ holds
    proc = run_cli(path, out, "--resume")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_resume_with_another_seed_is_refused(tmp_path: Path) -> None:
    """A study file whose seed changed is another plan: resumed, every trial it submitted was
    dead-lettered and the run waited for ever (or, once finished, printed the old seed's answer).
    Refused, naming both seeds, and nothing is appended."""
    path = write(tmp_path / "study.py", VALID + "seed = 7\n")
    out = tmp_path / "out"
    assert run_cli(path, out).returncode == 0
    (out / "summary.json").unlink()
    (out / "summary-tiny.json").unlink()
    log = EmbeddedLog(out / "log", read_only=True)
    try:
        before = log.end_offset(topics.PLAN)
    finally:
        log.close()
    write(path, VALID + "seed = 8\n")
    proc = run_cli(path, out, "--resume")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "ran with seed 7" in err and "gives seed 8" in err, err
    log = EmbeddedLog(out / "log", read_only=True)
    try:
        assert log.end_offset(topics.PLAN) == before
    finally:
        log.close()


@pytest.mark.parametrize(("edit", "named"), [
    (("steps=1", "steps=2"), "`steps`: 1 in the log, 2 now"),
    (('"lr": [0.1]', '"lr": [0.1, 0.05]'), "`space.configurations`: 1 in the log, 2 now"),
    (("GridSearch(", "type('GridSearch', (GridSearch,), {'rules': 2})("), "`rules`: 1 in the log, 2 now"),
])
def test_cli_resume_with_other_tuner_settings_is_refused(tmp_path: Path, edit: tuple[str, str], named: str) -> None:
    """A study file whose tuner changed (an argument, the space, or the version of its decision
    rules) is another study: resumed, the new tuner's decisions were mixed with the old one's,
    and ``replay verify`` then failed on the earlier run's. Refused, naming the first
    difference, with nothing appended; restored, it resumes."""
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    assert run_cli(path, out).returncode == 0
    with EmbeddedLog(out / "log", read_only=True) as log:
        before = log.end_offset(topics.PLAN)
    write(path, VALID.replace(*edit))
    proc = run_cli(path, out, "--resume")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "ran with other tuner settings" in err and named in err, err
    with EmbeddedLog(out / "log", read_only=True) as log:
        assert log.end_offset(topics.PLAN) == before
    if edit[0] == '"lr": [0.1]':  # as the message says: under another name, beside the first, on its plan
        write(path, VALID.replace(*edit).replace('name = "tiny"', 'name = "tiny-more"'))
        proc = run_cli(path, out)
        assert proc.returncode == 0 and "steps answered from earlier studies" in proc.stdout, proc.stdout
    write(path, VALID)
    proc = run_cli(path, out, "--resume")
    assert proc.returncode == 0 and "nothing to resume" in proc.stdout, proc.stdout + proc.stderr


def test_cli_resume_of_another_study_is_refused_and_summaries_are_per_study(tmp_path: Path) -> None:
    """Issue 11 item 9: ``--resume`` in a directory that holds only other studies is refused
    (exit 2, naming them), nothing is appended, and no study overwrites another's summary."""
    out = tmp_path / "out"
    first = run_cli(write(tmp_path / "a.py", VALID), out)
    assert first.returncode == 0, first.stdout + first.stderr
    before = (out / "summary.json").read_bytes()
    other = write(tmp_path / "b.py", VALID.replace('name = "tiny"', 'name = "other"'))
    log = EmbeddedLog(out / "log", read_only=True)
    records = log.end_offset(topics.PLAN)
    log.close()
    proc = run_cli(other, out, "--resume")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = squash(proc.stderr)
    assert "--resume" in err and "'other'" in err and "'tiny'" in err and "without--resume" in err
    log = EmbeddedLog(out / "log", read_only=True)
    assert log.end_offset(topics.PLAN) == records
    log.close()
    added = run_cli(other, out)  # the documented way to add a study
    assert added.returncode == 0, added.stdout + added.stderr
    assert (out / "summary.json").read_bytes() == before
    assert orjson.loads(summary_path(out, "other").read_bytes())["name"] == "other"
    assert orjson.loads(summary_path(out, "tiny").read_bytes())["name"] == "tiny"


@pytest.mark.parametrize(("held", "flags"), [("trial", ["--no-merge"]), ("merged", [])], ids=["no-merge", "merged"])
def test_cli_resume_in_the_other_mode_is_refused_before_anything_is_written(tmp_path: Path, held: str,
                                                                             flags: list[str]) -> None:
    """``--resume`` without ``--no-merge`` of a ``--no-merge`` run, and with it of a merged one:
    exit 2 naming the modes and how to resume it (the flag to give or to drop, not the one the
    command gave: "(with --no-merge)" once followed a command without it), with the log as it was
    (no worker joined, nothing dispatched), and the directory resumes in its own mode after it."""
    path = write(tmp_path / "study.py", VALID)
    out = tmp_path / "out"
    first = run_cli(path, out, *flags)
    assert first.returncode == 0, first.stdout + first.stderr

    def records() -> list[bytes]:
        with EmbeddedLog(out / "log", read_only=True) as log:
            return [r.value for r in log.read(topics.PLAN)]

    before = records()
    other = "merged" if held == "trial" else "trial"
    refused = run_cli(path, out, "--resume", *([] if flags else ["--no-merge"]))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    err = squash(refused.stderr)
    hint = "resumeitwith--no-merge" if held == "trial" else "resumeitwithout--no-merge"
    assert f"'{held}'runof'tiny'" in err and f"cannotcontinueas'{other}':{hint}" in err, err
    assert err.count("--no-merge") == 1 and "Traceback" not in err, err
    assert records() == before
    resumed = run_cli(path, out, "--resume", *flags)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr


def test_cli_a_tuner_metric_the_trainer_does_not_report_fails_at_the_first_answer(tmp_path: Path) -> None:
    """A typo in the tuner's ``metric``: exit 2 naming the metric and what the trainer reports, at
    the first answer rather than after every trial has trained (it was a KeyError's traceback
    once GridSearch ranked its results). With the metric fixed the tuner's settings differ, so
    ``--resume`` is refused naming `metric`; the fixed study under another name, beside the
    first, finishes on the same plan, its steps answered from what the first trained."""
    from events.codec import decode
    from events.models import MetricsReported, TrialSubmitted

    grid = 'GridSearchSpace({"lr": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "batch_size": [32], "momentum": [0.0]})'
    body = VALID.replace('GridSearchSpace({"lr": [0.1], "batch_size": [32], "momentum": [0.0]})', grid)
    path = write(tmp_path / "study.py", body.replace('metric="val_acc"', 'metric="val_accuracy"'))
    out = tmp_path / "out"
    proc = run_cli(path, out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = squash(proc.stderr)
    assert "Traceback" not in proc.stderr and "`metric`is'val_accuracy'" in err and "['val_acc','val_loss']" in err, err
    with EmbeddedLog(out / "log", read_only=True) as log:
        events = [decode(r.value) for r in log.read(topics.PLAN)]
    assert sum(isinstance(e, TrialSubmitted) for e in events) == 6
    assert sum(isinstance(e, MetricsReported) for e in events) < 6  # it stopped at the first answer
    write(path, body)
    refused = run_cli(path, out, "--resume")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert squash('`metric`: "val_accuracy" in the log, "val_acc" now') in squash(refused.stderr), refused.stderr
    write(path, body.replace('name = "tiny"', 'name = "tiny-fixed"'))
    fixed = run_cli(path, out)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert len(orjson.loads(summary_path(out, "tiny-fixed").read_bytes())["trials"]) == 6


def test_cli_a_pbt_mutation_the_trainer_lacks_is_refused_before_anything_is_created(tmp_path: Path) -> None:
    body = VALID.replace("tuner = GridSearch(", "from stagetree.tuners import PBT\ntuner = PBT(").replace(
        'steps=1, metric="val_acc")', 'metric="val_acc", population=1, interval=1, max_steps=2, '
        'mutations={"nope": [0.1]})')
    out = tmp_path / "out"
    proc = run_cli(write(tmp_path / "study.py", body), out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    err = squash(proc.stderr)
    assert "Traceback" not in proc.stderr and "`mutations`names'nope',whichtrainer'DigitsTrainer'lacks" in err, err
    assert not out.exists()


def test_cli_warns_of_configurations_that_start_at_one_number_in_two_types(tmp_path: Path) -> None:
    """``Constant(32)`` and ``MultiStep(32, ..., 2.0)`` (32.0 until its milestone) share no step:
    the run says so on stderr, naming the hyper-parameter and both values, and goes on."""
    body = VALID.replace('"batch_size": [32]', '"batch_size": [32, MultiStep(32, (5,), 2.0)]').replace(
        "steps=1", "steps=6")
    proc = run_cli(write(tmp_path / "study.py", "from events.hp import MultiStep\n" + body), tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    err = squash(proc.stderr)
    assert "warning:" in err and "`batch_size`startsat32(int)" in err and "32.0(float)" in err, err
    assert orjson.loads((tmp_path / "out" / "summary.json").read_bytes())["unique_steps"] == 12  # shared nothing
    clean = run_cli(write(tmp_path / "ints.py", VALID), tmp_path / "ints")
    assert clean.returncode == 0 and "warning" not in clean.stderr, clean.stderr


def test_cli_flags_are_checked_before_anything_is_created(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 11 item 10: a file as --out, a directory under a file, an unknown device, a
    checkpoint store (a Kafka-mode flag) given to an embedded run: exit 2 naming the flag and
    value, nothing created, and the corrected run then starts there, with the store's variable
    (a deployment's environment) set and not used."""
    path = write(tmp_path / "study.py", VALID)
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    cases = [(["--out", str(afile)], ["--out", str(afile), "is a file"]),
             (["--out", str(afile / "sub")], ["--out", "which is a file"]),
             (["--out", str(tmp_path / "dev"), "--device", "bogus"], ["--device", "'bogus'"]),
             (["--out", str(tmp_path / "dev"), "--device", "cuda:7"], ["--device", "'cuda:7'"]),
             (["--out", str(tmp_path / "dev"), "--device", "mps"], ["--device", "'mps'", "auto, cpu or cuda:N"]),
             (["--out", str(tmp_path / "dev"), "--device", "meta"], ["--device", "'meta'", "auto, cpu or cuda:N"]),
             (["--out", str(tmp_path / "dev"), "--device", "cpu:1"], ["--device", "'cpu:1'", "auto, cpu or cuda:N"]),
             (["--out", "/proc/stagetree-none/run"], ["--out", "'/proc/stagetree-none/run'", "cannot be created"]),
             (["--out", str(tmp_path / "dev"), "--checkpoint-store", str(tmp_path / "store")],
              ["--checkpoint-store", repr(str(tmp_path / "store")), "is for Kafka mode", "OUT/checkpoints"])]
    for flags, needles in cases:
        assert cli(["run", str(path), "--quiet", *flags]) == 2
        err = squash(capsys.readouterr().err)
        assert "Traceback" not in err and all(squash(n) in err for n in needles), err
    assert not (tmp_path / "dev").exists() and not (tmp_path / "store").exists()
    monkeypatch.setenv("STAGETREE_CHECKPOINT_STORE", str(tmp_path / "store"))
    proc = run_cli(path, tmp_path / "dev", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert any((tmp_path / "dev" / "checkpoints").iterdir()) and not (tmp_path / "store").exists()
    assert "(merged, 1 worker)" in proc.stdout, proc.stdout  # not "1 workers"




def test_cli_worker_checkpoint_cache_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache size without a cache directory, or a size that is not one, is refused before the
    worker contacts anything, naming the flag or variable and the value."""
    worker = ["worker", "--bootstrap-servers", "127.0.0.1:1", "--checkpoint-store", str(tmp_path / "store"),
              "--worker-id", "w0"]
    assert cli([*worker, "--checkpoint-cache-bytes", "1GB"]) == 2
    assert "--checkpoint-cache-bytes" in squash(capsys.readouterr().err)
    assert cli([*worker, "--checkpoint-cache", str(tmp_path / "cache"), "--checkpoint-cache-bytes", "lots"]) == 2
    err = squash(capsys.readouterr().err)
    assert "--checkpoint-cache-bytes" in err and "'lots'" in err
    monkeypatch.setenv("STAGETREE_CHECKPOINT_CACHE_BYTES", "-3")
    assert cli([*worker, "--checkpoint-cache", str(tmp_path / "cache")]) == 2
    err = squash(capsys.readouterr().err)
    assert "$STAGETREE_CHECKPOINT_CACHE_BYTES" in err and "'-3'" in err
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(("argv", "env", "needles"), [
    (["worker", "--heartbeat", "0"], {}, ["--heartbeat", "'0'"]),
    (["worker", "--heartbeat", "nan"], {}, ["--heartbeat", "'nan'"]),
    (["serve", "--heartbeat-timeout", "-1"], {}, ["--heartbeat-timeout", "'-1'"]),
    (["serve", "--session-timeout", "0"], {}, ["--session-timeout", "'0'"]),
    (["serve", "--session-timeout", "100000"], {}, ["--session-timeout", "<90", "'100000'"]),
    (["serve", "--app-id", "bad app/"], {}, ["--app-id", "'badapp/'"]),
    (["serve"], {"STAGETREE_SESSION_TIMEOUT": "abc"}, ["--session-timeout", "'abc'"]),
    (["worker"], {"STAGETREE_PLAN_PARTITIONS": "zero"}, ["--plan-partitions", "'zero'"]),
    (["worker", "--topic-prefix", "bad prefix/"], {}, ["--topic-prefix", "'badprefix/'"]),
    (["worker", "--topic-prefix", "p" * 201], {}, ["--topic-prefix", "atmost200characters"]),
    (["worker", "--worker-id", "", "--checkpoint-store", "/nonexistent"], {}, ["--worker-idis''"]),
    (["worker", "--device", "gpu0", "--checkpoint-store", "/nonexistent"], {}, ["--deviceis'gpu0'"]),
], ids=["heartbeat-0", "heartbeat-nan", "heartbeat-timeout", "session-0", "session-over-faust", "app-id",
        "session-env", "partitions-env", "topic-prefix", "topic-prefix-long", "worker-id", "device"])
def test_cli_kafka_flags_and_their_variables_are_checked(argv: list[str], env: dict[str, str], needles: list[str],
                                                         capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Seconds of a heartbeat or timeout (finite, > 0; a session under faust's request timeout),
    an app id that names topics, and the variables that give their defaults: exit 2 naming
    the flag and the value, before anything contacts the broker (which does not exist here).
    A heartbeat of 0 sent thousands of beats a second; a session timeout the broker refuses
    left serve waiting for ever; an app id or a variable that is not a number, a traceback."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli([*argv, "--bootstrap-servers", "127.0.0.1:1"]) == 2
    err = squash(capsys.readouterr().err)
    assert "Traceback" not in err and all(n in err for n in needles), err


@pytest.mark.parametrize("servers", ["127.0.0.1:abc", "host:notaport", "127.0.0.1:99999", "a:1,,b:2",
                                     "kafka://127.0.0.1:9092"])
def test_cli_a_mistyped_kafka_address_is_refused_at_once(servers: str, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """It went to librdkafka, which tried it for a minute before the exit."""
    for argv in (["serve", "--bootstrap-servers", servers], ["worker", "--checkpoint-store", "/nonexistent"]):
        monkeypatch.setenv("STAGETREE_BOOTSTRAP_SERVERS", servers)  # the variable, checked as the flag
        assert cli(argv) == 2
        err = squash(capsys.readouterr().err)
        assert "--bootstrap-servers" in err and squash(repr(servers)) in err and "Traceback" not in err, err


@pytest.mark.parametrize("source", ["kafka://127.0.0.1:99999/x", "kafka://127.0.0.1/x", "kafka://:9092"])
def test_cli_a_mistyped_kafka_source_is_refused_at_once(source: str, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A port out of range passed the source's own looser check and waited for a broker."""
    assert cli(["replay", "verify", source]) == 2
    assert cli(["log", "export", source, "--out", str(tmp_path / "e.jsonl")]) == 2
    err = squash(capsys.readouterr().err)
    assert squash("must be kafka://HOST:PORT") in err and squash("ports 1 to 65535") in err, err
    assert "Traceback" not in err, err


def test_cli_a_serve_state_dir_that_is_empty_or_no_directory_is_refused(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``--state-dir ""`` made the working directory the state directory; a file named as one,
    and a symbolic link to nothing (as ``run --out``), were refused with the reason "File
    exists"."""
    assert cli(["serve", "--bootstrap-servers", "127.0.0.1:1", "--state-dir", ""]) == 2
    assert squash("--state-dir: must be a directory path, got ''") in squash(capsys.readouterr().err)
    afile = write(tmp_path / "afile", "")
    assert cli(["serve", "--bootstrap-servers", "127.0.0.1:1", "--state-dir", str(afile)]) == 2
    err = squash(capsys.readouterr().err)
    assert "--state-dir" in err and squash("it is not a directory") in err and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")  # said "File exists"
    assert cli(["serve", "--bootstrap-servers", "127.0.0.1:1", "--state-dir", str(dangling)]) == 2
    err = squash(capsys.readouterr().err)
    assert squash(f"it is a symbolic link to {str(tmp_path / 'nowhere')!r}, which does not exist") in err, err
    study = write(tmp_path / "study.py", VALID)
    assert cli(["run", str(study), "--out", str(dangling)]) == 2
    err = squash(capsys.readouterr().err)
    assert squash(f"--out {str(dangling)!r} cannot be created: it is a symbolic link") in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "link", "study.py"]


def test_cli_a_study_name_that_is_no_file_name_stays_under_runs(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The default run directory is ``runs/<name>``: a ``name`` such as ``../escaped`` made it
    ``./escaped``, outside ``runs/``. It becomes one file name (as the study's summary file's).
    An empty ``--out`` is refused rather than read as none."""
    from projections.summary import file_safe

    path = write(tmp_path / "study.py", VALID.replace('name = "tiny"', 'name = "../escaped"'))
    assert cli(["run", str(path), "--out", ""]) == 2
    assert "--out is ''" in capsys.readouterr().err
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(path), "--workers", "1", "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(EXAMPLES.parent)})  # this checkout's code
    assert proc.returncode == 0, proc.stdout + proc.stderr
    safe = file_safe("../escaped")
    assert safe.startswith("escaped-") and len(safe) == len("escaped-") + 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "study.py"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [safe]
    assert orjson.loads(summary_path(tmp_path / "runs" / safe, "../escaped").read_bytes())["name"] == "../escaped"


def test_cli_a_long_study_name_still_gets_its_summary(tmp_path: Path) -> None:
    """A ``name`` longer than a file name can be trained to the end and then failed to write
    its summary (errno 36, a traceback, no summary). Names over 100 characters are cut to 100
    plus 8 hex characters of their sha256, so two long names still never share a file."""
    from projections.summary import file_safe

    long = "a" * 300
    assert file_safe(long) == "a" * 100 + "-" + file_safe(long)[-8:] != file_safe(long + "a")
    assert file_safe("a" * 100) == "a" * 100
    path = write(tmp_path / "study.py", VALID.replace('name = "tiny"', f'name = "{long}"'))
    proc = run_cli(path, tmp_path / "out")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert orjson.loads(summary_path(tmp_path / "out", long).read_bytes())["name"] == long
    assert orjson.loads((tmp_path / "out" / "summary.json").read_bytes())["name"] == long


@pytest.mark.parametrize("value", ["inf", "1e999", "Infinity", "nan", "-1", "abc", "10XB"])
def test_a_size_that_is_not_a_finite_positive_number_of_bytes_is_bad_input(value: str, tmp_path: Path,
                                                                           monkeypatch, capsys) -> None:
    """``--checkpoint-budget inf`` (and through ``$STAGETREE_CHECKPOINT_BUDGET``, in ``run`` and
    ``simulate``) was an OverflowError traceback, exit 1; ``simulate`` read no variable at all."""
    study = REPO / "tests" / "studies" / "tiny_grid.py"
    out = tmp_path / "out"
    assert cli(["run", str(study), "--out", str(out), "--checkpoint-budget", value]) == 2
    err = squash(capsys.readouterr().err)
    assert "--checkpoint-budget" in err and f"'{value}'" in err and "Traceback" not in err, err
    monkeypatch.setenv("STAGETREE_CHECKPOINT_BUDGET", value)
    for argv in (["run", str(study), "--out", str(out)], ["simulate", str(study), "--out", str(out)]):
        assert cli(argv) == 2, argv
        err = squash(capsys.readouterr().err)
        assert "$STAGETREE_CHECKPOINT_BUDGET" in err and f"'{value}'" in err and "Traceback" not in err, (argv, err)
    assert not out.exists()

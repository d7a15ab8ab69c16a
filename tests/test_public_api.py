"""The public API (issue 13 item 1): ``from stagetree import ...`` is all a user needs.

A study file that imports only from :mod:`stagetree` runs, for every tuner family; the old
import paths keep working; importing the package does not import torch or the tuners (names
resolve on first use).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

import stagetree

STUDY = Path(__file__).parent / "studies" / "public_api.py"
FAMILIES = ["GridSearch", "SuccessiveHalving", "EarlyStopTuner", "ASHA", "Hyperband", "MedianStopping", "PBT",
            "MLtunerTuner"]


def test_every_public_name_resolves() -> None:
    for name in stagetree.__all__:
        assert getattr(stagetree, name) is not None, name
    assert stagetree.hp.MultiStep(0.1, [5], 0.1).value(5) == pytest.approx(0.01)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        stagetree.Nope  # noqa: B018


def test_the_old_import_paths_still_work() -> None:
    from gpu_worker.trainer import Trainer
    from stagetree.mltuner import MLtunerTuner
    from stagetree.spaces import GridSearchSpace as SpacesGrid
    from stagetree.tuners import GridSearchSpace, RandomSearchSpace, SuccessiveHalving, continue_with, stable_seed

    assert Trainer is stagetree.Trainer and MLtunerTuner is stagetree.MLtunerTuner
    assert GridSearchSpace is SpacesGrid is stagetree.GridSearchSpace
    assert RandomSearchSpace is stagetree.RandomSearchSpace and SuccessiveHalving is stagetree.SuccessiveHalving
    assert callable(continue_with) and callable(stable_seed)


def test_importing_the_package_imports_nothing_heavy() -> None:
    code = "import sys, stagetree; print(sorted(m for m in ('torch', 'stagetree.tuners') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_command_line_imports_nothing_heavy_before_its_command_runs() -> None:
    """Importing ``stagetree.cli`` and parsing a command line is what every command pays first,
    what ``stagetree run`` pays before it starts its workers, and what every worker process pays
    again (multiprocessing runs the parent's main module in each): none of it imports torch,
    pydantic, the log or asyncio (issue 15 goal 1: start-up)."""
    heavy = ("torch", "pydantic", "rocksdict", "confluent_kafka", "opentelemetry", "asyncio", "events.models",
             "events.log", "scheduler.decide", "replay.audit")
    code = ("import sys, stagetree.cli\n"
            "stagetree.cli.parser().parse_args(['run', 'study.py', '--workers', '2'])\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_package_is_typed() -> None:
    assert (Path(stagetree.__file__).parent / "py.typed").is_file()


@pytest.mark.e2e
@pytest.mark.parametrize("family", FAMILIES)
def test_a_study_file_importing_only_stagetree_runs(family: str, tmp_path: Path) -> None:
    env = {**os.environ, "STAGETREE_TEST_TUNER": family}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(STUDY), "--workers", "1", "--out",
                           str(out), "--quiet"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["name"] == f"public-{family}" and summary["best_trial"] is not None
    assert all(t["status"] in ("done", "cancelled") for t in summary["trials"])


GUARDED = """import json, sys
import stagetree
if __name__ == "__main__":
    summary = stagetree.run_study(sys.argv[1], out=sys.argv[2], workers=1, device="cpu")
    print(json.dumps(summary))
"""


@pytest.mark.e2e
def test_run_study_runs_a_study_file_from_a_script_and_returns_its_summary(tmp_path: Path) -> None:
    """``stagetree.run_study`` does what ``stagetree run`` does (the run directory, its log and
    summary.json) and returns the summary it wrote; a script that calls it outside
    ``if __name__ == "__main__":`` is told so by name instead of multiprocessing's riddle."""
    env = {**os.environ, "STAGETREE_TEST_TUNER": "GridSearch"}
    script = tmp_path / "go.py"
    script.write_text(GUARDED)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), str(STUDY), str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    returned = orjson.loads(proc.stdout.strip().splitlines()[-1])
    assert returned.pop("out") == str(out) and returned.pop("summary_file") == str(out / "summary.json")
    assert returned == orjson.loads((out / "summary.json").read_bytes())
    assert returned["name"] == "public-GridSearch" and returned["best_trial"] is not None
    assert returned["total_steps"] == returned["unique_steps"] == 18  # 3 trials of 6 steps, starting apart
    assert all(t["status"] == "done" for t in returned["trials"])

    unguarded = tmp_path / "bare.py"
    unguarded.write_text(GUARDED.replace('if __name__ == "__main__":\n', "").replace("\n    ", "\n"))
    proc = subprocess.run([sys.executable, str(unguarded), str(STUDY), str(tmp_path / "bare")], capture_output=True,
                          text=True, timeout=300, env=env)
    err = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and 'call run_study under `if __name__ == "__main__":`' in err, err


@pytest.mark.parametrize(("kwargs", "needles"), [
    ({"workers": 0}, ["`workers` is 0"]),
    ({"workers": True}, ["`workers` is True"]),
    ({"checkpoint_budget": "lots"}, ["`checkpoint_budget`", "'lots'"]),
    ({"checkpoint_budget": 1.5}, ["`checkpoint_budget` is 1.5"]),
    ({"device": "gpu0"}, ["--device", "'gpu0'"]),
    ({"merge": "False"}, ["`merge` is 'False'", "True or False"]),
    ({"resume": "no"}, ["`resume` is 'no'"]),
    ({"out": 3}, ["`out` is 3", "must be a path"]),
])
def test_run_study_refuses_bad_arguments_before_anything_is_created(tmp_path: Path, kwargs: dict,
                                                                    needles: list[str]) -> None:
    with pytest.raises(ValueError) as caught:
        stagetree.run_study(STUDY, **{"out": tmp_path / "run", **kwargs})
    assert all(n in str(caught.value) for n in needles), caught.value
    assert not (tmp_path / "run").exists()

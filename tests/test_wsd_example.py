"""The WSD cooldown example (examples/wsd_cooldown.py) at its test size, through ``stagetree run``
(conftest ``wsd_runs``): merged and ``--no-merge`` give bit-identical per-trial metrics while
merging trains the shared warm-up and constant phase once; the schedules are the ones the example
describes."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest

from gpu_worker.loader import load_module

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "wsd_cooldown.py"


def _summary(run: Path) -> dict:
    return orjson.loads((run / "summary.json").read_bytes())


def test_merged_and_no_merge_give_bit_identical_metrics(wsd_runs: dict[str, Path]) -> None:
    merged, trial = _summary(wsd_runs["merged"]), _summary(wsd_runs["trial"])
    per_trial = {t["trial_id"]: (t["steps"], t["metrics"]) for t in merged["trials"]}
    assert per_trial == {t["trial_id"]: (t["steps"], t["metrics"]) for t in trial["trials"]}
    assert len(per_trial) == 7 and all(t["status"] == "done" for t in merged["trials"])
    assert merged["best_trial"] == trial["best_trial"] and merged["best_metric"] == trial["best_metric"]
    # the trunk (warm-up + constant) is trained once: 48 steps of it, 6 cooldowns of 4 and 8 steps
    assert merged["executed_steps"] == merged["unique_steps"] == 48 + 3 * (4 + 8) - 6  # a cooldown's step 0 is the peak
    assert trial["executed_steps"] == trial["total_steps"] == merged["total_steps"] == 264
    assert merged["merge_rate"] == pytest.approx(264 / 78)
    assert all(math.isfinite(t["metrics"]["val_loss"]) and t["metrics"]["val_loss"] < math.log(128)
               for t in merged["trials"])  # it learns: below the uniform guess of 128 characters


def test_the_schedules_are_warmup_stable_decay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WSD_SIZE", "test")
    study = load_module(str(EXAMPLE))
    size = study.SIZE
    plan = study.schedules()
    (constant, ends), *cooldowns = plan
    assert ends == [24, 48] and len(cooldowns) == 6
    lr = constant["lr"]
    assert [lr.value(s) for s in (0, size.warmup, 1000)] == [0.0, size.peak_lr, size.peak_lr]
    peak = size.peak_lr
    for config, (end,) in cooldowns:
        fn = config["lr"]
        start = {24: 20, 48: 40}[end]
        length = end - start
        assert fn.value(start - 1) == fn.value(start) == peak and fn.value(end) == 0.0
        mid = fn.value(start + length // 2)
        assert mid in (pytest.approx(peak / 2), pytest.approx(peak * (1 - math.sqrt(0.5))))
        # every schedule agrees with the constant one up to its cooldown: the shared trunk
        assert all(fn.value(s) == lr.value(s) for s in range(start + 1))
    shapes = sorted(str(c["lr"].functions[1]).split("(")[0] for c, _ in cooldowns)
    assert shapes == ["Piecewise", "Piecewise", "PowerRamp", "PowerRamp", "PowerRamp", "PowerRamp"]
    with pytest.raises(ValueError, match="`shape` is 'step'"):
        study.cooldown("step", peak, 10)

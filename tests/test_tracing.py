"""OpenTelemetry: one trace per trial across the coordinator (SDK, projector, scheduler) and the
worker processes, with correct parent links, collected with the JSONL exporter."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import orjson
import pytest

from events import tracing

STUDY = Path(__file__).parent / "studies" / "tiny_sha.py"


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of the study run traced; its spans are in ``spans.jsonl`` beside it."""
    tmp = tmp_path_factory.mktemp("traced")
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(STUDY), "--workers", "2",
                           "--out", str(tmp / "run"), "--quiet", "--otel-exporter", f"jsonl:{tmp / 'spans.jsonl'}"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return tmp / "run"


@pytest.fixture(scope="module")
def spans(traced_run: Path) -> list[dict]:
    return [orjson.loads(line) for line in (traced_run.parent / "spans.jsonl").read_bytes().splitlines()]


def test_each_trial_is_one_trace_across_processes_with_parent_links(spans: list[dict]) -> None:
    by_id = {s["span_id"]: s for s in spans}
    roots = [s for s in spans if s["name"] == "trial.submit" and s["parent_id"] is None]
    assert len(roots) == 16  # one trace per trial of the study
    assert len({s["trace_id"] for s in roots}) == 16
    traces: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        traces[s["trace_id"]].append(s)

    def parent(s: dict) -> dict:
        return by_id[s["parent_id"]]

    full = 0
    for root in roots:
        trace = traces[root["trace_id"]]
        names = {s["name"] for s in trace}
        if not {"dispatch", "dispatch.process", "train", "checkpoint.save"} <= names:
            continue  # trials whose stages were dispatched in another trial's trace (linked there)
        full += 1
        pids = {s["resource"]["process.pid"] for s in trace}
        assert len(pids) >= 2  # coordinator and worker processes
        for s in trace:
            if s["name"] == "trial.submit" and s["parent_id"] is not None:
                assert parent(s)["name"] == "trial.submit"  # a promotion continues the trial's trace
            if s["name"].startswith("projection.apply"):
                assert s["kind"] == "CONSUMER"
                assert s["attributes"]["messaging.operation.type"] == "process"
            if s["name"] == "projection.apply TrialSubmitted":
                assert parent(s)["name"] == "trial.submit"
            if s["name"] == "schedule":
                assert parent(s)["name"] == "trial.submit"
            if s["name"] == "dispatch":
                assert parent(s)["name"] == "schedule" and s["kind"] == "PRODUCER"
                assert s["attributes"]["messaging.destination.name"] == "stagetree.dispatch"
            if s["name"] == "dispatch.process":
                assert parent(s)["name"] == "dispatch" and s["kind"] == "CONSUMER"
                assert s["resource"]["process.pid"] != parent(s)["resource"]["process.pid"]
                assert s["resource"]["service.name"].startswith("stagetree-worker-")
            if s["name"] in ("train", "evaluate", "checkpoint.save"):
                assert parent(s)["name"] == "stage" and parent(parent(s))["name"] == "dispatch.process"
    assert full >= 4
    # a dispatch serving several trials links to the other trials' traces
    assert any(s["links"] for s in spans if s["name"] == "schedule")


def test_replay_verify_emits_no_span_of_the_runs_messages(traced_run: Path, spans: list[dict],
                                                         tmp_path: Path) -> None:
    """``replay verify`` recomputes the tuner's decisions over the log: it emitted a
    ``trial.submit`` PRODUCER span for every request it recomputed (31 here), none of them
    published, and a ``projection.apply`` CONSUMER span for every event its replay folded, in the
    run's own traces, as if the run's trials were submitted and consumed again. It emits none."""
    path = tmp_path / "verify-spans.jsonl"
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "replay", "verify", str(traced_run), "--quiet",
                           "--otel-exporter", f"jsonl:{path}"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tuner decisions of 1 study recomputed" in " ".join(proc.stdout.split()), proc.stdout
    emitted = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert not [s for s in emitted if s["name"] == "trial.submit"], emitted
    run_traces = {s["trace_id"] for s in spans}
    assert not [s for s in emitted if s["trace_id"] in run_traces or s["kind"] in ("PRODUCER", "CONSUMER")], emitted


def test_tracing_off_installs_nothing_and_events_carry_no_context() -> None:
    tracing.configure("none", "test")
    assert not tracing.enabled() and tracing.carrier() is None
    with tracing.span("x") as s:
        assert s is None


def test_an_unknown_exporter_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="zipkin"):
        tracing.configure("zipkin", "test")


def test_a_jsonl_file_that_cannot_be_written_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    """It was taken, and each span then failed to export in a traceback of its own (1,384 lines
    for a small study), exit 0, no span kept."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    spec = f"jsonl:{a_file}/spans.jsonl"
    with pytest.raises(ValueError, match="cannot be written"):
        tracing.configure(spec, "test")
    from stagetree.cli import main

    assert main(["run", str(Path(__file__).parent / "studies" / "tiny_sha.py"), "--out", str(tmp_path / "run"),
                 "--otel-exporter", spec]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--otel-exporter" in err and "cannot be written" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()

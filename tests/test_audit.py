"""Reproducibility audits on a real finished study: hash chains, verify, export/import, re-execution."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from events import topics
from events.codec import decode
from events.log import LogError, Record, chain_next
from projections.store import ProjectionStore
from replay.audit import Stream, open_source, verify
from stagetree.cli import main

STUDY = Path(__file__).parent / "studies" / "tiny_sha.py"
KEY = "audit-secret"


def _run(out: Path, *flags: str, env: dict | None = None, study: Path = STUDY) -> None:
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(study), "--workers", "2",
                           "--out", str(out),
                           "--quiet", *flags], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit") / "run"
    _run(out)
    return out


@pytest.fixture(scope="module")
def keyed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("audit-keyed") / "run"
    _run(out, "--log-key", KEY)
    return out


@pytest.fixture
def export(run_dir: Path, tmp_path: Path) -> Path:
    path = tmp_path / "log.jsonl"
    assert main(["log", "export", str(run_dir), "--out", str(path)]) == 0
    return path


def lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


def write(path: Path, rows: list[dict]) -> None:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def first_failure(path: Path, run_dir: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    code = main(["replay", "verify", str(path), "--checkpoints", str(run_dir / "checkpoints"), "--quiet", *extra])
    out = capsys.readouterr().out
    assert code == 1, out
    return out.split("verification failed:")[1]


def plan_rows(rows: list[dict]) -> list[tuple[int, dict]]:
    return [(i, r) for i, r in enumerate(rows) if r.get("stream") == "stagetree.plan"]


def test_verify_passes_on_a_clean_run_and_its_export(run_dir: Path, export: Path, capsys) -> None:
    assert main(["replay", "verify", str(run_dir), "--quiet"]) == 0
    assert main(["replay", "verify", str(export), "--checkpoints", str(run_dir / "checkpoints"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.count("verified") == 2 and "FAILED" not in out
    result = verify(open_source(run_dir))
    assert result.ok and {c["name"] for c in result.checks} == {"chain", "decision", "projection", "checkpoint"}


def test_an_audit_writes_nothing_in_the_run_directory(run_dir: Path, capsys) -> None:
    """``replay verify`` and ``report`` open the log and the projection read-only and write
    nothing where they are: rocksdict rewrites its config file beside a database on every open,
    so an audit touched every run it read, and on a read-only file system (an auditor's copy)
    it failed with EROFS. Every file's bytes and modification time stay; no file is added."""
    def files() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(run_dir)): (p.stat().st_mtime_ns, p.stat().st_size)
                for p in sorted(run_dir.rglob("*")) if p.is_file()}

    before = files()
    assert main(["replay", "verify", str(run_dir), "--quiet"]) == 0
    assert main(["report", str(run_dir), "--out", str(run_dir.parent / "report.html")]) == 0
    capsys.readouterr()
    assert files() == before


def test_checks_that_cannot_be_made_are_said_to_be_skipped_not_ok(export: Path, tmp_path: Path, capsys) -> None:
    """An export whose header holds no projection digest, verified without its checkpoints: the
    projection and checkpoint checks are listed as skipped (the text, --json), not as passed,
    and not left out (the projection check was silently absent)."""
    rows = lines(export)
    assert "projection_sha256" in rows[0]
    del rows[0]["projection_sha256"]
    bare = tmp_path / "bare.jsonl"
    write(bare, rows)
    report = tmp_path / "audit.json"
    assert main(["replay", "verify", str(bare), "--quiet", "--json", str(report)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "skipped projection: not checked" in out and "skipped checkpoint: not checked" in out, out
    assert "ok chain" in out and "verified" in out
    checks = {c["name"]: c for c in orjson.loads(report.read_bytes())["checks"]}
    assert checks["projection"]["skipped"] and checks["checkpoint"]["skipped"] and not checks["chain"]["skipped"]


def test_an_edited_metric_value_fails_at_its_offset(run_dir: Path, export: Path, capsys) -> None:
    rows = lines(export)
    i, row = next((i, r) for i, r in plan_rows(rows) if '"MetricsReported"' in r["value"])
    event = orjson.loads(row["value"])
    event["payload"]["metrics"]["val_acc"] = 1.0
    rows[i]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    write(export, rows)
    msg = first_failure(export, run_dir, capsys)
    assert f"chain check failed at offset {row['offset']} (MetricsReported)" in msg


def test_of_several_broken_streams_verify_names_the_first_by_name(export: Path) -> None:
    """The plan stream's chain is checked in the fold's own pass, the other streams' in a pass
    each: the first failure reported is still that of the first stream by name, as when every
    stream was checked in one loop."""
    source = open_source(export)
    plan = list(source.streams[topics.PLAN])
    edited = Record(topics.PLAN, 3, plan[3].key, plan[3].value.replace(b'"', b' "', 1), plan[3].chain)
    source.streams[topics.PLAN] = Stream(topics.PLAN, (0,), lambda p: iter([*plan[:3], edited, *plan[4:]]))

    def broken(name: str) -> list[Record]:
        return [Record(name, 0, "k", b"{}", bytes(32))]

    source.streams["stagetree.zz"] = broken("stagetree.zz")
    failure = verify(source).first_failure
    assert failure is not None and failure.check == "chain" and failure.offset == 3
    assert f"stream {topics.PLAN}:" in failure.detail
    source.streams["stagetree.aa"] = broken("stagetree.aa")
    failure = verify(source).first_failure
    assert failure is not None and failure.detail.startswith("stream stagetree.aa:"), failure


def test_a_deleted_event_fails_at_its_offset(run_dir: Path, export: Path, capsys) -> None:
    rows = lines(export)
    i, row = plan_rows(rows)[5]
    del rows[i]
    write(export, rows)
    msg = first_failure(export, run_dir, capsys)
    assert f"offset {row['offset']} is missing" in msg


def test_two_swapped_events_fail_at_the_first(run_dir: Path, export: Path, capsys) -> None:
    rows = lines(export)
    (i, a), (j, b) = plan_rows(rows)[7:9]
    rows[i] = {**b, "offset": a["offset"], "chain": a["chain"]}
    rows[j] = {**a, "offset": b["offset"], "chain": b["chain"]}
    write(export, rows)
    msg = first_failure(export, run_dir, capsys)
    assert f"chain check failed at offset {a['offset']}" in msg


def test_an_inserted_forged_dispatch_fails(run_dir: Path, export: Path, capsys) -> None:
    rows = lines(export)
    plan = plan_rows(rows)
    i, dispatch = next((i, r) for i, r in plan if '"StageDispatched"' in r["value"])
    forged = orjson.loads(dispatch["value"])
    forged["payload"]["stages"][0]["to_step"] += 5
    at = dispatch["offset"]
    # the forger re-seals the plain sha256 chain from the insertion point on, as anyone can
    head = bytes.fromhex(rows[i - 1]["chain"]) if i > 0 and rows[i - 1]["stream"] == "stagetree.plan" else bytes(32)
    new = {**dispatch, "value": orjson.dumps(forged, option=orjson.OPT_SORT_KEYS).decode()}
    stream = [r for _, r in plan]
    k = stream.index(dispatch)
    resealed = stream[:k] + [new] + stream[k:]
    for offset, r in enumerate(resealed[k:], start=k):
        r["offset"] = offset
        head = chain_next(head, r["stream"], offset, r["key"], r["value"].encode())
        r["chain"] = head.hex()
    others = [r for r in rows if r.get("stream") not in (None, "stagetree.plan")]
    rows[0]["streams"]["stagetree.plan"] += 1  # and fixes the header's count, which is not chained
    write(export, [rows[0], *resealed, *others])
    msg = first_failure(export, run_dir, capsys)
    # the chain is intact, but the scheduler would not have decided this
    assert f"decision check failed at offset {at} (StageDispatched)" in msg


def test_a_replaced_checkpoint_object_fails_at_its_checkpoint_event(run_dir: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    source = open_source(copy)
    record = next(r for r in source.streams["stagetree.plan"] if decode(r.value).type == "CheckpointSaved")
    ref = decode(record.value).ref
    obj = copy / "checkpoints" / ref[:2] / ref
    data = obj.read_bytes()
    obj.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    assert main(["replay", "verify", str(copy), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"checkpoint check failed at offset {record.offset} (CheckpointSaved)" in out
    assert ref in out


def test_a_keyed_chain_cannot_be_resealed_without_the_key(keyed_run: Path, tmp_path: Path, capsys) -> None:
    path = tmp_path / "keyed.jsonl"
    assert main(["log", "export", str(keyed_run), "--out", str(path), "--log-key", KEY]) == 0
    assert main(["replay", "verify", str(path), "--log-key", KEY, "--quiet"]) == 0
    rows = lines(path)
    i, row = next((i, r) for i, r in plan_rows(rows) if '"MetricsReported"' in r["value"])
    event = orjson.loads(row["value"])
    event["payload"]["metrics"]["val_acc"] = 1.0
    rows[i]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    head = bytes.fromhex(rows[i - 1]["chain"])
    for r in rows[i:]:  # re-seal with a guessed key
        if r["stream"] == "stagetree.plan":
            head = chain_next(head, r["stream"], r["offset"], r["key"], r["value"].encode(), b"guess")
            r["chain"] = head.hex()
    write(path, rows)
    capsys.readouterr()
    assert main(["replay", "verify", str(path), "--log-key", KEY, "--quiet"]) == 1
    assert f"chain check failed at offset {row['offset']} (MetricsReported)" in capsys.readouterr().out
    # and without the key, the keyed log does not verify at all
    assert main(["replay", "verify", str(keyed_run), "--quiet"]) == 1
    assert "chained with hmac-sha256, but verification was given no secret" in capsys.readouterr().out


def test_a_keyed_run_directory_takes_no_study_and_no_optuna_trial_under_another_key(keyed_run: Path,
                                                                                     tmp_path: Path) -> None:
    """``run --resume``-less studies added to a keyed run directory, and an Optuna journal on
    it, took records chained with a mistyped ``--log-key``: the log never verified again, under
    either key. Refused (exit 2, naming ``--log-key``), nothing written; verify still passes."""
    import optuna

    from stagetree.integration.optuna import journal_storage

    copy = tmp_path / "run"
    shutil.copytree(keyed_run, copy)
    proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(STUDY.with_name("tiny_sha_b.py")),
                           "--workers", "1", "--out", str(copy), "--quiet", "--log-key", "not-the-key"],
                          capture_output=True, text=True, timeout=600)
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "chained with another key" in err and "--log-key" in err, proc.stdout + err
    with pytest.raises(LogError, match="chained with another key"):
        optuna.create_study(study_name="o", storage=journal_storage(copy, log_key="not-the-key"))
    assert main(["replay", "verify", str(copy), "--log-key", KEY, "--quiet"]) == 0


@pytest.mark.parametrize(("key", "needle"), [
    (None, "the log is chained with hmac-sha256, but no key was given"),
    ("not-the-key", "not the key the log was chained with"),
])
def test_a_keyed_log_is_exported_only_with_its_key(keyed_run: Path, run_dir: Path, tmp_path: Path, key: str | None,
                                                  needle: str, capsys) -> None:
    """``log export`` of a keyed log without its key, or with another, wrote a file (exit 0)
    whose header's projection digest, computed with that key, never verified: found at audit
    time as an apparent tampering. It is refused, naming ``--log-key``, and writes nothing."""
    path = tmp_path / "keyed.jsonl"
    assert main(["log", "export", str(keyed_run), "--out", str(path), *(["--log-key", key] if key else [])]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"--log-key: {needle}" in err and "Traceback" not in err, err
    assert not path.exists()
    plain = tmp_path / "plain.jsonl"  # and a log chained without a key is not exported with one
    assert main(["log", "export", str(run_dir), "--out", str(plain), "--log-key", KEY]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--log-key: the log is chained with sha256, but a key was given" in err and not plain.exists(), err


def test_export_then_import_verifies_and_replays_to_identical_projections(run_dir: Path, export: Path,
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "imported"
    assert main(["log", "import", str(export), "--out", str(out)]) == 0
    assert main(["replay", "verify", str(out), "--checkpoints", str(run_dir / "checkpoints"), "--quiet"]) == 0
    original, imported = ProjectionStore(run_dir / "state"), ProjectionStore(out / "state")
    try:
        assert imported.records() == original.records()
    finally:
        original.close()
        imported.close()


def test_reexecute_reproduces_the_study_with_another_worker_count(run_dir: Path, capsys) -> None:
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    assert summary["workers"] == 2
    assert main(["replay", "reexecute", str(run_dir), "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "reproduced" in out and "bit for bit on 1 worker" in out and "1 workers" not in out


def test_reexecute_reports_a_divergence_by_trial_node_and_step(run_dir: Path, tmp_path: Path, capsys) -> None:
    """A trainer that computes something else (here: another dropout) is caught stage by stage."""
    study = tmp_path / "changed.py"
    examples = Path(__file__).resolve().parents[1] / "examples"
    study.write_text(
        STUDY.read_text()
        .replace('Path(__file__).resolve().parents[2] / "examples"', repr(str(examples)))
        .replace("trainer = DigitsTrainer()", "import digits\ndigits.DROPOUT = 0.5\ntrainer = DigitsTrainer()")
    )
    code = main(["replay", "reexecute", str(run_dir), "--workers", "2", "--sample", "3", "--seed", "1",
                 "--study", str(study), "--quiet"])
    out = capsys.readouterr().out
    assert code == 1
    assert "diverged: checkpoint of node n" in out and "at step" in out and "trials " in out


def test_reexecute_reports_a_source_checkpoint_it_cannot_read_and_runs_the_other_stages(run_dir: Path,
                                                                                        tmp_path: Path, capsys) -> None:
    """A source checkpoint deleted or damaged since the run: its stages are reported as not
    re-executed, naming the checkpoint and why (exit 1), and every other stage is compared."""
    from replay.reexecute import recorded_stages

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    stages = recorded_stages(open_source(copy))
    sources = sorted({s.source_ref for s in stages if s.source_ref is not None})
    assert len(sources) >= 2
    missing, damaged = sources[:2]
    (copy / "checkpoints" / missing[:2] / missing).unlink()
    path = copy / "checkpoints" / damaged[:2] / damaged
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert main(["replay", "reexecute", str(copy), "--workers", "2", "--quiet"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    unreadable = sum(s.source_ref in (missing, damaged) for s in stages)
    assert f"{unreadable} divergences in {len(stages)} stages" in out, out
    assert f"not re-executed: checkpoint {missing} is missing" in out
    assert f"not re-executed: checkpoint {damaged} is corrupt" in out and "Traceback" not in out


def test_reexecute_refuses_a_study_file_that_is_missing_or_has_another_trainer(run_dir: Path, tmp_path: Path,
                                                                              capsys) -> None:
    """Checked before any stage runs (exit 2, naming the file): a study file that does not load,
    and one whose trainer is not the recorded one (its stages would diverge for that reason)."""
    assert main(["replay", "reexecute", str(run_dir), "--study", str(tmp_path / "none.py"), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "none.py" in err and "does not exist" in err and "Traceback" not in err, err
    other = tmp_path / "other.py"
    examples = Path(__file__).resolve().parents[1] / "examples"
    other.write_text(
        STUDY.read_text()
        .replace('Path(__file__).resolve().parents[2] / "examples"', repr(str(examples)))
        .replace("trainer = DigitsTrainer()", "class Other(DigitsTrainer):\n    name = 'Other'\n\n\n"
                                              "trainer = Other()")
    )
    assert main(["replay", "reexecute", str(run_dir), "--study", str(other), "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "has trainer Other@1, but the log records DigitsTrainer@1" in err, err


def test_a_run_holding_a_record_that_is_not_utf8_exports_verifies_and_imports(run_dir: Path, tmp_path: Path,
                                                                               capsys) -> None:
    """Issue 11 item 6: a dead-lettered non-UTF-8 record must not stop an export; every record is
    carried byte for byte, so verify and import work on the export."""
    from events import topics
    from events.log import EmbeddedLog
    from projections.store import Projector

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    garbage = b"\xff\xfe not an event \x00\x81"
    log = EmbeddedLog(run / "log")
    try:
        offset = log.append(topics.PLAN, "garbage", garbage)
        store = ProjectionStore(run / "state")
        Projector(log, store=store).catch_up()  # the live projector dead-letters it
        store.close()
    finally:
        log.close()
    assert main(["replay", "verify", str(run), "--quiet"]) == 0
    export = tmp_path / "log.jsonl"
    assert main(["log", "export", str(run), "--out", str(export)]) == 0
    rows = [r for r in lines(export)[1:] if r["stream"] == topics.PLAN and r["offset"] == offset]
    assert len(rows) == 1 and "value_b64" in rows[0] and "value" not in rows[0]
    assert main(["replay", "verify", str(export), "--checkpoints", str(run / "checkpoints"), "--quiet"]) == 0
    again = tmp_path / "imported"
    assert main(["log", "import", str(export), "--out", str(again)]) == 0
    assert main(["replay", "verify", str(again), "--checkpoints", str(run / "checkpoints"), "--quiet"]) == 0
    imported = EmbeddedLog(again / "log", read_only=True)
    try:
        assert next(iter(imported.read(topics.PLAN, offset, offset + 1))).value == garbage
    finally:
        imported.close()
    capsys.readouterr()


# ----------------------------------------------------------------------------- tuner decisions and explain


def explain_json(run_dir: Path, trial: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["replay", "explain", str(run_dir), trial, "--json"]) == 0
    return orjson.loads(capsys.readouterr().out)


def explain_text(run_dir: Path, trial: str, capsys) -> str:
    capsys.readouterr()
    assert main(["replay", "explain", str(run_dir), trial]) == 0
    return capsys.readouterr().out


def test_verify_recomputes_the_real_studys_tuner_decisions(run_dir: Path, capsys) -> None:
    from replay.tuner import plan_events

    decided = [e for _, e in plan_events(open_source(run_dir)) if e.type == "TunerDecided"]
    capsys.readouterr()
    assert main(["replay", "verify", str(run_dir), "--quiet"]) == 0
    assert f"ok tuner: {len(decided)} tuner decisions of 1 study recomputed" in capsys.readouterr().out
    # SHA over 16 trials, rungs 10, 20, 40, 80, 160 (reduction 2): 16 draws, 8 + 4 + 2 + 1 promotions,
    # 8 + 4 + 2 + 1 stops, one answer
    kinds = [e.decision.kind for e in decided]
    assert (kinds.count("draw"), kinds.count("promote"), kinds.count("stop"), kinds.count("answer")) == (16, 15, 15, 1)


def test_explain_tells_why_a_trial_was_stopped_at_the_first_rung(run_dir: Path, capsys) -> None:
    from replay.audit import fold

    state = fold(open_source(run_dir).streams["stagetree.plan"])
    at_10 = {t.trial_id: t.results[10]["val_acc"] for t in state.trials.values()}
    ranked = sorted(at_10, key=lambda t: (-at_10[t], t))  # SHA's rank: best first, ties by trial id
    threshold = at_10[ranked[7]]  # the worst of the 8 kept
    stopped = ranked[12]
    doc = explain_json(run_dir, stopped[:10], capsys)  # a unique prefix
    assert doc["trial_id"] == stopped and doc["study_id"] == "tiny" and doc["tuner"] == "SuccessiveHalving"
    assert [d["kind"] for d in doc["decisions"]] == ["draw", "stop"]
    stop = doc["decisions"][-1]["decision"]
    assert stop["step"] == 10 and stop["rung"] == 0 and stop["reason"] == "rank"
    assert stop["evidence"] == {"rule": "rank", "metric": "val_acc", "mode": "max", "value": at_10[stopped],
                                "rank": 13, "of": 16, "kept": 8, "threshold": threshold}
    assert [r["steps"] for r in doc["requests"]] == [10] and doc["steps"] == 10
    text = explain_text(run_dir, stopped, capsys)
    assert (f"step 10: stopped by SuccessiveHalving, rung 0: rank 13 of 16 by val_acc {at_10[stopped]:.4f}, top 8 "
            f"kept (threshold {threshold:.4f})") in text
    assert "configuration:" in text and "lr  " in text and "stages that trained it" in text


def test_explain_tells_a_promoted_trials_and_the_best_trials_decisions(run_dir: Path, capsys) -> None:
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    steps = {t["trial_id"]: t["steps"] for t in summary["trials"]}
    promoted = next(t for t in sorted(steps) if steps[t] == 20)  # promoted at rung 0, stopped at rung 1
    doc = explain_json(run_dir, promoted, capsys)
    assert [(d["kind"], d["decision"]["step"]) for d in doc["decisions"]] == [("draw", 0), ("promote", 10),
                                                                               ("stop", 20)]
    promote = doc["decisions"][1]["decision"]
    assert promote["to_step"] == 20 and promote["evidence"]["rank"] <= 8 and promote["evidence"]["of"] == 16
    text = explain_text(run_dir, promoted, capsys)
    assert "step 10: promoted by SuccessiveHalving, rung 0: rank" in text and "; to step 20" in text
    assert "step 20: stopped by SuccessiveHalving, rung 1: rank" in text and "of 8 by val_acc" in text

    best = summary["best_trial"]
    doc = explain_json(run_dir, best, capsys)
    assert [d["kind"] for d in doc["decisions"]] == ["draw"] + ["promote"] * 4 + ["answer"]
    answer = doc["decisions"][-1]["decision"]
    assert answer["step"] == 160 and answer["evidence"]["value"] == summary["best_metric"]
    assert answer["evidence"]["rank"] == 1 and answer["evidence"]["of"] == 1  # 16 -> 8 -> 4 -> 2 -> 1
    assert [m["step"] for m in doc["metrics"]] == [10, 20, 40, 80, 160]
    assert doc["checkpoints"][-1]["step"] == 160
    covered = sorted((s["from_step"], s["to_step"]) for s in doc["stages"] if s["status"] == "finished")
    assert covered[0][0] == 0 and covered[-1][1] == 160
    assert all(a[1] >= b[0] for a, b in zip(covered, covered[1:]))  # its stages train [0, 160) without gaps
    assert any(s["shared"] and best in s["trials"] and len(s["trials"]) > 1 for s in doc["stages"])
    assert all(0 < s["diverges_at"] <= 160 for s in doc["shares_prefix_with"])
    text = explain_text(run_dir, best, capsys)
    assert (f"step 160: chosen as the answer by SuccessiveHalving: rank 1 of 1 by val_acc "
            f"{summary['best_metric']:.4f}") in text


def test_explain_refuses_an_unknown_or_ambiguous_trial_id(run_dir: Path, capsys) -> None:
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    ids = sorted(t["trial_id"] for t in summary["trials"])
    shared = next(a[:1] for a, b in zip(ids, ids[1:]) if a[:1] == b[:1])
    assert main(["replay", "explain", str(run_dir), "zz"]) == 2
    assert main(["replay", "explain", str(run_dir), shared]) == 2
    assert main(["replay", "explain", str(run_dir), ""]) == 2  # every id starts with ''
    err = " ".join(capsys.readouterr().err.split())
    assert "no trial id starts with 'zz'" in err and f"trial id prefix '{shared}' is not unique" in err
    assert "a trial id or a prefix of one must not be empty" in err


def test_a_projection_behind_its_log_fails_verify_unless_read_as_of_the_projection(run_dir: Path,
                                                                                   tmp_path: Path) -> None:
    # A running coordinator appends, then folds: between the two the stored projection lags the
    # log by a record. `as_of_projection` (the dashboard's verify) reads the pair consistently.
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    from events import topics
    from events.log import EmbeddedLog, append_events
    from events.models import WorkerJoined

    with EmbeddedLog(copy / "log") as log:
        append_events(log, topics.PLAN, [("w9", WorkerJoined(producer="test", worker_id="w9", device="cpu"))])
    behind = verify(open_source(copy))
    assert not behind.ok and behind.first_failure.check == "projection"
    consistent = open_source(copy, as_of_projection=True)
    assert consistent.left_out == 1
    assert verify(consistent).ok


@pytest.mark.parametrize(("url", "expected"), [
    ("kafka://127.0.0.1:9092", ("127.0.0.1:9092", "")),
    ("kafka://127.0.0.1:9092/", ("127.0.0.1:9092", "")),
    ("kafka://h1:9092,h2:9093/test-1.", ("h1:9092,h2:9093", "test-1.")),
    ("kafka://127.0.0.1:9092/test-1.stagetree.plan", ("127.0.0.1:9092", "test-1.")),
    ("kafka://127.0.0.1:9092/stagetree.plan", ("127.0.0.1:9092", "")),
])
def test_kafka_location_takes_a_prefix_or_the_plan_topic(url: str, expected: tuple[str, str]) -> None:
    from replay.audit import kafka_location

    assert kafka_location(url) == expected


@pytest.mark.parametrize(("url", "why"), [
    ("kafka://", "HOST:PORT"), ("kafka://host", "HOST:PORT"), ("kafka://u:p@host:9092", "credentials"),
    ("kafka://host:9092/a b", "prefix"), ("http://host:9092", "kafka://"),
])
def test_kafka_location_refuses_bad_addresses_by_name(url: str, why: str) -> None:
    from replay.audit import AuditError, kafka_location

    with pytest.raises(AuditError, match=why) as info:
        kafka_location(url)
    assert "u:p" not in str(info.value)


def test_a_run_that_ended_before_its_first_record_verifies(tmp_path: Path, capsys) -> None:
    """A run whose worker failed to start (its trainer's build raised at warm-up) leaves an empty
    log and an empty projection: nothing to fail. Verify failed its projection check ("differs
    from the log's fold at record 'meta'") and named old logs as the reason for no tuner check."""
    from events.log import EmbeddedLog

    EmbeddedLog(tmp_path / "run" / "log").close()
    ProjectionStore(tmp_path / "run" / "state").close()
    assert main(["replay", "verify", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "ok projection: the log holds no plan record and nothing was projected" in out
    assert "the log holds no study" in out and "written before" not in out


def test_a_tuner_check_that_could_not_be_made_is_skipped_and_a_wrong_study_file_refused(
        run_dir: Path, tmp_path: Path, capsys) -> None:
    """A run whose study file is gone had its tuner check listed as ok (never made); a --study
    file that defines none of the log's studies passed with exit 0."""
    other = Path(__file__).parent / "studies" / "tiny_grid.py"  # defines 'tiny-grid', not 'tiny'
    assert main(["replay", "verify", str(run_dir), "--study", str(other)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "defines no study whose decisions the log holds" in err and "'tiny-grid'" in err, err
    study = tmp_path / "gone.py"
    study.write_text(f"import sys\nsys.path.insert(0, {str(STUDY.parent)!r})\n"
                     "from tiny_sha import name, seed, trainer, tuner  # noqa: F401\n")
    _run(tmp_path / "run", study=study)
    study.unlink()
    out = tmp_path / "verify.json"
    assert main(["replay", "verify", str(tmp_path / "run"), "--json", str(out)]) == 0
    tuner = next(c for c in orjson.loads(out.read_bytes())["checks"] if c["name"] == "tuner")
    assert tuner["skipped"] and "no study file" in tuner["detail"], tuner
    assert "skipped tuner" in capsys.readouterr().out


def test_outputs_that_cannot_be_written_are_refused_before_the_work(run_dir: Path, tmp_path: Path, capsys) -> None:
    """Each was a traceback (exit 1); verify's --json only once the whole audit had run."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, needle in [
        (["report", str(run_dir), "--out", str(a_file)], "is a file"),
        (["replay", "verify", str(run_dir), "--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
        (["replay", "verify", str(run_dir), "--json", str(a_file / "x.json")], "does not exist"),
        (["log", "export", str(run_dir), "--out", str(tmp_path)], "must name a file"),
        (["log", "import", str(a_file), "--out", str(a_file)], "is a file"),
    ]:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        err = " ".join(captured.err.split())
        assert needle in err and "Traceback" not in err and "verified" not in captured.out, (argv, err)


def test_a_cut_off_export_fails(run_dir: Path, export: Path, tmp_path: Path, capsys) -> None:
    """Records cut off the end of a stream chain correctly (a prefix of a chain is a chain): an
    export's header lists each stream's records, and verify passed a file cut short."""
    lines = export.read_bytes().splitlines(keepends=True)
    dispatch = [i for i, line in enumerate(lines[1:], 1) if b'"stream":"stagetree.dispatch"' in line]
    assert dispatch
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(line for i, line in enumerate(lines) if i not in dispatch[-2:]))
    assert main(["replay", "verify", str(cut)]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"stream stagetree.dispatch: the export's header lists {len(dispatch)} records, the file holds " \
           f"{len(dispatch) - 2}" in out, out


def _rechain(rows: list[dict], stream: str) -> None:
    """Re-seal ``stream``'s plain sha256 chain after an edit, as anyone can."""
    head = bytes(32)
    for offset, r in enumerate(r for r in rows if r.get("stream") == stream):
        r["offset"] = offset
        head = chain_next(head, stream, offset, r["key"], r["value"].encode())
        r["chain"] = head.hex()


@pytest.mark.parametrize("tamper", ["edit", "cut"])
def test_the_dispatch_stream_must_hold_the_plans_decisions_byte_for_byte(run_dir: Path, export: Path, tamper: str,
                                                                           capsys) -> None:
    """What the workers were sent (the dispatch stream) was only chain-checked: a dispatch edited
    there and re-chained, or the stream cut short (its header count fixed), verified."""
    rows = lines(export)
    dispatch = [r for r in rows if r.get("stream") == "stagetree.dispatch"]
    assert len(dispatch) >= 2
    if tamper == "edit":
        event = orjson.loads(dispatch[1]["value"])
        event["payload"]["stages"][0]["to_step"] += 5
        dispatch[1]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    else:
        rows.remove(dispatch[-1])
        rows[0]["streams"]["stagetree.dispatch"] -= 1
    _rechain(rows, "stagetree.dispatch")
    write(export, rows)
    msg = " ".join(first_failure(export, run_dir, capsys).split())
    if tamper == "edit":
        assert "stream stagetree.dispatch offset 1: not the copy of the plan's next decision for workers" in msg, msg
    else:
        assert f"holds {len(dispatch) - 1} of the plan's {len(dispatch)} decisions for workers" in msg, msg


def test_a_duplicated_record_is_named_as_such_not_as_missing(run_dir: Path, export: Path, capsys) -> None:
    rows = lines(export)
    i, row = plan_rows(rows)[20]
    rows.insert(i + 1, dict(row))  # the same record twice
    rows[0]["streams"]["stagetree.plan"] += 1
    write(export, rows)
    msg = " ".join(first_failure(export, run_dir, capsys).split())
    assert f"offset {row['offset'] + 1} is not next: the record there has offset {row['offset']}" in msg, msg
    assert "duplicated or out of order" in msg and "missing" not in msg, msg


def _reexport(rows: list[dict], out: Path) -> Path:
    """``rows`` (an export's records) written as an export again, every stream re-chained with
    plain sha256 from offset 0 and the header (counts, projection digest) made anew: a forgery
    anyone can make of a log chained without a key."""
    from replay.audit import Source, export_log

    streams: dict[str, list[Record]] = {}
    heads: dict[str, bytes] = {}
    for row in rows:
        recs = streams.setdefault(row["stream"], [])
        value = row["value"].encode()
        heads[row["stream"]] = chain_next(heads.get(row["stream"], bytes(32)), row["stream"], len(recs), row["key"],
                                          value)
        recs.append(Record(row["stream"], len(recs), row["key"], value, heads[row["stream"]]))
    export_log(Source(out, "export", streams, "sha256", None), out)
    return out


@pytest.mark.parametrize("tamper", ["cut", "rewrite"])
def test_an_anchor_kept_apart_catches_a_log_cut_or_rewritten_with_its_header(run_dir: Path, export: Path,
                                                                                tmp_path: Path, tamper: str,
                                                                                capsys) -> None:
    """The audit gap of a chain without a key: an export cut after some plan record, or with a
    record rewritten (here an informational timestamp, which no decision reads), re-chained and
    with its header made anew, verifies. The run's anchor (``log_anchor`` in its summary, and
    printed by ``stagetree run`` and ``replay verify``), kept apart, catches both."""
    anchor = orjson.loads((run_dir / "summary.json").read_bytes())["log_anchor"]
    assert main(["replay", "verify", str(run_dir), "--anchor", anchor, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"anchor: {anchor}" in " ".join(out.split()) and "ok anchor: the log holds the anchored record" in out
    header, *rows = lines(export)
    plan = [r for r in rows if r["stream"] == topics.PLAN]
    if tamper == "cut":  # the run as if it had ended earlier: its StudyFinished and what came after are gone
        finished = next(i for i, r in enumerate(plan) if '"StudyFinished"' in r["value"])
        rows = [r for r in rows if r["stream"] != topics.PLAN or r["offset"] < plan[finished]["offset"]]
    else:
        event = orjson.loads(plan[5]["value"])
        event["ts"] += 1.0
        plan[5]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()
    forged = _reexport(rows, tmp_path / "forged.jsonl")
    assert main(["replay", "verify", str(forged), "--quiet"]) == 0, capsys.readouterr().out  # the gap
    capsys.readouterr()
    msg = " ".join(first_failure(forged, run_dir, capsys, "--anchor", anchor).split())
    offset = int(anchor.split("@")[1].split(":")[0])
    if tamper == "cut":
        assert f"anchor check failed at offset {offset}: stream stagetree.plan ends at offset" in msg, msg
        assert "the log was cut" in msg, msg
    else:
        assert f"anchor check failed at offset {offset}: stream stagetree.plan: the chain after offset {offset} is " \
               in msg and "was rewritten" in msg, msg


@pytest.mark.parametrize(("field", "value"), [("best_metric", 1.0), ("best_trial", "t-other"), ("best_step", 7)])
def test_a_forged_answer_fails_the_tuner_check(run_dir: Path, export: Path, tmp_path: Path, field: str,
                                               value: object, capsys) -> None:
    """A study's StudyFinished (its best trial, metric and step) was compared with nothing: one
    rewritten, re-chained and with the header made anew verified. The tuner recomputed from the
    log answers, and the recorded answer must be that one."""
    header, *rows = lines(export)
    i, row = next((i, r) for i, r in enumerate(rows) if '"StudyFinished"' in r["value"])
    event = orjson.loads(row["value"])
    assert event["payload"]["best_step"] is not None and event["payload"][field] != value
    event["payload"][field] = value
    rows[i] = {**row, "value": orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()}
    forged = _reexport(rows, tmp_path / "forged.jsonl")
    msg = " ".join(first_failure(forged, run_dir, capsys).split())
    assert msg.startswith(f"tuner check failed at offset {row['offset']} (StudyFinished): study 'tiny' finished "
                          f"recording") and f"{field} {value!r}" in msg, msg
    assert "the tuner recomputed from the log answers best_trial" in msg, msg


def test_a_malformed_anchor_is_refused_naming_the_flag(run_dir: Path, capsys) -> None:
    assert main(["replay", "verify", str(run_dir), "--anchor", "stagetree.plan@12:xyz", "--quiet"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--anchor is 'stagetree.plan@12:xyz', but must be STREAM@OFFSET:CHAIN" in err, err


def test_an_anchor_reads_back_as_written_and_a_deployments_topics_are_not_anchored() -> None:
    from replay.anchor import Anchor, check_anchors
    from replay.audit import AuditError, Source

    anchor = Anchor.parse(f" stagetree.plan@177:{'ab' * 32}\n")
    assert (anchor.stream, anchor.offset, anchor.chain) == ("stagetree.plan", 177, "ab" * 32)
    assert Anchor.parse(str(anchor)) == anchor
    for bad in ("stagetree.plan@-1:" + "ab" * 32, "stagetree.plan:" + "ab" * 32, "stagetree.plan@1:" + "AB" * 32):
        with pytest.raises(ValueError, match="but must be STREAM@OFFSET:CHAIN"):
            Anchor.parse(bad)
    kafka = Source(Path("kafka://127.0.0.1:9092"), "kafka", {}, "sealed", None)
    with pytest.raises(AuditError, match="anchor an embedded run directory or its export"):
        check_anchors(kafka, [anchor])


def test_a_damaged_log_fails_verify_as_a_failed_chain_check_not_as_bad_input(run_dir: Path, tmp_path: Path,
                                                                              capsys) -> None:
    """A run whose log has a table block RocksDB cannot read, or whose metadata names a
    manifest that is not there: the read raises (not a shorter log), and ``replay verify``
    exited 2, as for a mistyped path. It is a failed verification (exit 1): the chain check
    names the damage, and no other check says "ok" over records it could not read. ``log
    export`` and ``report`` still fail (exit 2) and write nothing; a source that is not there
    is still bad input."""
    from replay.audit import LogDamaged

    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    table = max((damaged / "log").glob("*.sst"), key=lambda p: p.stat().st_size)
    data = bytearray(table.read_bytes())
    data[len(data) // 2] ^= 0xFF
    table.write_bytes(bytes(data))
    manifest = tmp_path / "manifest"
    shutil.copytree(run_dir, manifest)
    (manifest / "log" / "CURRENT").write_text("MANIFEST-999999\n")
    for run, damage in [(damaged, r"cannot be read (past offset \d+ of stream 'stagetree\.\w+' \(\d+ records\)|"
                                  r"\((its streams|the end of stream '[\w.]+')\)): the store reports Corruption"),
                        (manifest, r"cannot be opened \(damaged\?\).*MANIFEST-999999")]:
        report = tmp_path / f"{run.name}.json"
        assert main(["replay", "verify", str(run), "--quiet", "--json", str(report)]) == 1
        out = " ".join(capsys.readouterr().out.split())
        assert re.search(f"FAILED chain: chain check failed at the log: .*{damage}", out), out
        assert "verification failed: chain check failed" in out and not re.search(r"\bok \w+:", out), out
        checks = {c["name"]: c for c in orjson.loads(report.read_bytes())["checks"]}
        assert list(checks) == ["chain", "decision", "projection", "checkpoint", "tuner"]
        assert not checks["chain"]["ok"] and all(c["skipped"] for c in list(checks.values())[1:]), checks
        assert all("the log cannot be read" in c["detail"] for c in list(checks.values())[1:]), checks
        export = tmp_path / f"{run.name}.jsonl"
        for argv in (["log", "export", str(run), "--out", str(export)],
                     ["report", str(run), "--verify", "--out", str(tmp_path / f"{run.name}-report")]):
            assert main(argv) == 2, argv
            err = " ".join(capsys.readouterr().err.split())
            assert re.search(damage, err) and "Traceback" not in err, (argv, err)
        assert not export.exists() and not (tmp_path / f"{run.name}-report").exists()
    with pytest.raises(LogDamaged):  # met when the source is opened (listing its streams reads every block)
        open_source(damaged)
    assert main(["replay", "verify", str(tmp_path / "missing"), "--quiet"]) == 2
    assert main(["replay", "verify", str(tmp_path), "--quiet"]) == 2  # not a run directory
    assert "is not a run directory" in capsys.readouterr().err


def _edit_decisions(rows: list[dict], edit: Callable[[dict], bool]) -> int:
    """Apply ``edit`` to the payload of every scheduling decision, in the plan stream and in its
    copy for workers alike (the dispatch stream holds the plan's decisions byte for byte); returns
    how many records ``edit`` changed (it returns True for those). :func:`_reexport` re-seals."""
    changed = 0
    for r in rows:
        if r.get("stream") in (topics.PLAN, topics.DISPATCH):
            event = orjson.loads(r["value"])
            if event["type"] in ("StageDispatched", "CheckpointEvicted", "PathPreempted", "CheckpointRequested") \
                    and edit(event["payload"]):
                r["value"] = orjson.dumps(event).decode()
                changed += 1
    return changed


def test_a_decision_records_its_deciders_rules_and_other_rules_are_named(run_dir: Path, export: Path,
                                                                         capsys) -> None:
    """Every scheduling decision records the version of its decider's rules; one decided by
    other rules than this stagetree's is named as such, not as an edit."""
    rows = lines(export)
    dispatches = [orjson.loads(r["value"]) for r in rows
                  if r.get("stream") == topics.PLAN and '"StageDispatched"' in r["value"]]
    assert dispatches and all(d["payload"]["rules"] == 1 for d in dispatches)
    first = next(i for i, r in plan_rows(rows) if '"StageDispatched"' in r["value"])
    at, dispatch_id = rows[first]["offset"], dispatches[0]["payload"]["dispatch_id"]

    def later_rules(payload: dict) -> bool:
        if payload.get("dispatch_id") != dispatch_id or "stages" not in payload:
            return False
        payload["rules"] = 2
        return True

    assert _edit_decisions(rows, later_rules) == 2  # the plan's and the workers' copy
    _reexport(rows[1:], export)
    msg = " ".join(first_failure(export, run_dir, capsys).split())
    assert f"decision check failed at offset {at} (StageDispatched): decided by the dispatch decider's rules 2; " \
           "this stagetree decides by rules 1: verify the log with a stagetree of those rules" in msg, msg


def test_a_log_whose_decisions_record_no_rules_verifies_and_a_mismatch_there_may_be_older_rules(
        run_dir: Path, export: Path, tmp_path: Path, capsys) -> None:
    """A log written before decisions recorded their rules verifies as before; a decision of
    such a log that its decider does not compute is said to be an edit or older rules."""
    rows = lines(export)
    assert _edit_decisions(rows, lambda p: p.pop("rules") == 1) >= 2
    _reexport(rows[1:], export)
    assert main(["replay", "verify", str(export), "--checkpoints", str(run_dir / "checkpoints"), "--quiet"]) == 0, \
        capsys.readouterr().out
    capsys.readouterr()
    first = next(i for i, r in plan_rows(rows) if '"StageDispatched"' in r["value"])
    original = orjson.loads(rows[first]["value"])["payload"]

    def longer(payload: dict) -> bool:
        if payload != original:
            return False
        payload["stages"][0]["to_step"] += 5
        return True

    assert _edit_decisions(rows, longer) == 2
    _reexport(rows[1:], export)
    msg = " ".join(first_failure(export, run_dir, capsys).split())
    assert f"decision check failed at offset {rows[first]['offset']} (StageDispatched)" in msg, msg
    assert "the decision records no rules version: if the log predates 2026-11-28, it may have been decided by " \
           "older dispatch rules, not edited" in msg, msg


def _edit_first_metric(rows: list[dict]) -> None:
    i, row = next((i, r) for i, r in plan_rows(rows) if '"MetricsReported"' in r["value"])
    event = orjson.loads(row["value"])
    event["payload"]["metrics"]["val_acc"] = 0.999
    rows[i]["value"] = orjson.dumps(event, option=orjson.OPT_SORT_KEYS).decode()


@pytest.mark.parametrize(("tamper", "needle"), [
    ("cut", "chain check failed at the log: stream stagetree.plan: the export's header lists {n} records, the file "
            "holds {m} (cut off, or records added)"),
    ("rechained", "projection check failed at the log: the fold's digest"),
    ("edited", "chain check failed at offset"),
])
def test_log_import_refuses_an_export_that_fails_verify_and_writes_nothing(run_dir: Path, export: Path,
                                                                           tmp_path: Path, tamper: str, needle: str,
                                                                           capsys) -> None:
    """``log import`` wrote a run directory from an export cut short, or whose records were
    edited and re-chained (its header's projection digest no longer matching), and exit 0: the
    imported directory, without the header, then verified. It now checks the chain, the header's
    record counts and its projection digest first, and refuses (exit 1) writing nothing."""
    rows = lines(export)
    n = rows[0]["streams"]["stagetree.plan"]
    if tamper == "cut":
        del rows[-3:]  # the plan stream's last three records (streams are written in name order)
    else:
        _edit_first_metric(rows)
        if tamper == "rechained":
            _rechain(rows, "stagetree.plan")
    write(export, rows)
    assert main(["replay", "verify", str(export), "--quiet"]) == 1  # what verify says of the file
    capsys.readouterr()
    out = tmp_path / "imported"
    assert main(["log", "import", str(export), "--out", str(out)]) == 1
    text = " ".join(capsys.readouterr().out.split())
    assert f"import refused: {needle.format(n=n, m=n - 3)}" in text, text
    assert f"nothing was written (`stagetree replay verify {export}` tells the whole story)" in text, text
    assert not out.exists()
    out.mkdir()  # an existing, empty --out stays empty
    assert main(["log", "import", str(export), "--out", str(out)]) == 1
    assert not list(out.iterdir())


def test_log_import_refuses_a_keyed_export_with_another_key_and_writes_nothing(keyed_run: Path, tmp_path: Path,
                                                                                monkeypatch, capsys) -> None:
    """``log import --log-key WRONG`` of a keyed export said "imported" (exit 0) and wrote a
    directory that verified with neither key. The key is checked as ``log export`` checks it."""
    monkeypatch.delenv("STAGETREE_LOG_KEY", raising=False)
    path = tmp_path / "keyed.jsonl"
    assert main(["log", "export", str(keyed_run), "--out", str(path), "--log-key", KEY]) == 0
    out = tmp_path / "imported"
    for key, needle in [("not-the-key", "--log-key: not the key the log was chained with"),
                        (None, "--log-key: the log is chained with hmac-sha256, but no key was given")]:
        capsys.readouterr()
        assert main(["log", "import", str(path), "--out", str(out), *(["--log-key", key] if key else [])]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert needle in err and "Traceback" not in err, err
        assert not out.exists()
    assert main(["log", "import", str(path), "--out", str(out), "--log-key", KEY]) == 0
    assert main(["replay", "verify", str(out), "--log-key", KEY, "--quiet"]) == 0


@pytest.mark.parametrize("command", ["verify", "reexecute"])
def test_a_checkpoint_directory_that_is_not_there_is_bad_input_not_a_failed_audit(run_dir: Path, tmp_path: Path,
                                                                                   command: str, capsys) -> None:
    """A mistyped ``--checkpoints`` made every checkpoint "missing": a failed audit (exit 1)
    or a divergence, where the input was wrong. A local one must be a directory (exit 2, named);
    ``file://DIR`` is a local one too."""
    extra = ["--sample", "1"] if command == "reexecute" else []
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    for bad, why in [(str(tmp_path / "nonexist"), "does not exist"), (str(afile), "is not a directory"),
                     (f"file://{tmp_path / 'nonexist'}", "does not exist")]:
        assert main(["replay", command, str(run_dir), "--checkpoints", bad, "--quiet", *extra]) == 2, bad
        captured = capsys.readouterr()
        err = " ".join(captured.err.split())
        assert f"--checkpoints {bad!r} {why}" in err and "Traceback" not in err, err
        assert "FAILED" not in captured.out and "diverged" not in captured.out, captured.out
    assert main(["replay", "verify", str(run_dir), "--checkpoints", f"file://{run_dir / 'checkpoints'}",
                 "--quiet"]) == 0


@pytest.mark.parametrize(("value", "label"), [
    (b'{"op_code":6,"worker_id":"w","trial_id":0,"state":1,"values":[0.5],"datetime_complete":null}',
     "optuna op_code 6"),
    (b"not a journal operation", "undecodable"),
])
def test_a_chain_failure_in_the_optuna_journal_names_the_journal_operation(tmp_path: Path, value: bytes, label: str,
                                                                          capsys) -> None:
    """A tampered record of the Optuna journal's stream was labelled "(undecodable)": it is a
    journal operation, not an event. Only a record that is neither is undecodable."""
    from events.log import EmbeddedLog

    log = EmbeddedLog(tmp_path / "run" / "log")
    try:
        log.append_many(topics.OPTUNA, [
            ("a.0", b'{"op_code":0,"worker_id":"w","study_name":"s","directions":[1]}'),
            ("b.0", b'{"op_code":4,"worker_id":"w","study_id":0,"datetime_start":null}'),
            ("c.0", value)])
    finally:
        log.close()
    export = tmp_path / "optuna.jsonl"
    assert main(["log", "export", str(tmp_path / "run"), "--out", str(export)]) == 0
    rows = lines(export)
    rows[3]["value"] = rows[3]["value"].replace("0.5", "0.9").replace("journal", "JOURNAL")  # an edit
    write(export, rows)
    capsys.readouterr()
    assert main(["replay", "verify", str(export), "--quiet"]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert f"chain check failed at offset 2 ({label}): stream stagetree.optuna: the hash chain does not match" in out, \
        out


@pytest.mark.parametrize("command", ["explain", "reexecute"])
def test_explain_and_reexecute_refuse_another_log_key(keyed_run: Path, run_dir: Path, command: str, monkeypatch,
                                                      capsys) -> None:
    """``--log-key`` was never checked by ``replay explain`` and ``replay reexecute``:
    ``reexecute --log-key wrong`` said "reproduced". The key is checked as ``log export``'s."""
    monkeypatch.delenv("STAGETREE_LOG_KEY", raising=False)
    trial = orjson.loads((keyed_run / "summary.json").read_bytes())["best_trial"]
    args = {"explain": [trial], "reexecute": ["--sample", "1", "--quiet"]}[command]
    for source, key, needle in [(keyed_run, "not-the-key", "--log-key: not the key the log was chained with"),
                                (keyed_run, None, "--log-key: the log is chained with hmac-sha256, but no key"),
                                (run_dir, KEY, "--log-key: the log is chained with sha256, but a key was given")]:
        argv = ["replay", command, str(source), *args, *(["--log-key", key] if key else [])]
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        err = " ".join(captured.err.split())
        assert needle in err and "Traceback" not in err, (argv, err)
        assert "reproduced" not in captured.out and trial not in captured.out, captured.out
    assert main(["replay", command, str(keyed_run), *args, "--log-key", KEY]) == 0


def test_report_verify_refuses_another_log_key_and_writes_nothing(keyed_run: Path, run_dir: Path, tmp_path: Path,
                                                                  monkeypatch, capsys) -> None:
    """``report --verify --log-key WRONG`` wrote a report (exit 0) whose audit showed the chain
    broken at offset 0: a tampering that is not there. The key is checked as ``replay explain``
    checks it (exit 2 naming ``--log-key``), before anything is written."""
    monkeypatch.delenv("STAGETREE_LOG_KEY", raising=False)
    out = tmp_path / "report"
    for source, key, needle in [(keyed_run, "not-the-key", "--log-key: not the key the log was chained with"),
                                (keyed_run, None, "--log-key: the log is chained with hmac-sha256, but no key"),
                                (run_dir, KEY, "--log-key: the log is chained with sha256, but a key was given")]:
        argv = ["report", str(source), "--verify", "--out", str(out), *(["--log-key", key] if key else [])]
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert needle in err and "$STAGETREE_LOG_KEY" in err and "Traceback" not in err, (argv, err)
        assert not out.exists()
    monkeypatch.setenv("STAGETREE_LOG_KEY", "not-the-key")  # the variable is checked as the flag is
    assert main(["report", str(keyed_run), "--verify", "--out", str(out)]) == 2
    assert "--log-key: not the key the log was chained with" in " ".join(capsys.readouterr().err.split())
    assert not out.exists()
    assert main(["report", str(keyed_run), "--verify", "--out", str(out), "--log-key", KEY]) == 0
    assert 'class="audit ok"' in (out / "index.html").read_text()


def test_the_dashboard_refuses_another_log_key_before_it_serves(keyed_run: Path, tmp_path: Path) -> None:
    """``stagetree dashboard KEYED_RUN --log-key WRONG`` served the run, and its *replay verify*
    showed the chain broken at offset 0: a tampering that is not there. A key that is not a
    keyed run directory's or export's own is refused (exit 2 naming ``--log-key``, from the
    flag or ``$STAGETREE_LOG_KEY``) before anything is served; the right key, or none, is served."""
    import os

    from stagetree.dashboard import open_dashboard_source
    from stagetree.dashboard.source import SourceError

    env = {k: v for k, v in os.environ.items() if k != "STAGETREE_LOG_KEY"}
    for flags, extra in [(["--log-key", "not-the-key"], {}), ([], {"STAGETREE_LOG_KEY": "not-the-key"})]:
        proc = subprocess.run([sys.executable, "-m", "stagetree.dashboard", str(keyed_run), "--port", "0", *flags],
                              capture_output=True, text=True, timeout=120, env={**env, **extra})
        err = " ".join(proc.stderr.split())
        assert proc.returncode == 2, (flags, extra, proc.stdout + err)
        assert "--log-key: not the key the log was chained with" in err and "$STAGETREE_LOG_KEY" in err, err
        assert "not-the-key" not in err and "Traceback" not in err, err
        assert proc.stdout == ""  # it never listened
    export = tmp_path / "keyed.jsonl"
    assert main(["log", "export", str(keyed_run), "--out", str(export), "--log-key", KEY]) == 0
    with pytest.raises(SourceError, match="^--log-key: not the key the log was chained with"):
        open_dashboard_source(str(export), b"not-the-key")
    for where in (keyed_run, export):
        for key in (KEY.encode(), None):  # its key, or none: the views need none (verify says so)
            open_dashboard_source(str(where), key).close()

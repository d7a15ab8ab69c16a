"""stagetree's log as an Optuna storage (stagetree.integration.optuna.journal_storage).

Optuna's own storage contract suite (``optuna.testing.pytest_storages.StorageTestCase``) runs
against a run directory's embedded log and a Kafka topic; a journal written by one process
replays into the same study in a new one; several processes share a run directory's log (one
owns it, the others go through it), also when the owner is killed; the journal stream is
hash-chained in the run directory, so ``replay verify`` sees an edit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import optuna
import orjson
import pytest
from optuna.testing.pytest_storages import StorageTestCase

from events import topics
from events.kafka_log import KafkaLogError
from events.log import EmbeddedLog, LogLocked
from events.shared_log import SharedEmbeddedLog
from replay.audit import open_source, verify
from stagetree.integration.optuna import (
    JournalDecodeError,
    KafkaJournalBackend,
    RunDirJournalBackend,
    journal_backend,
    journal_storage,
)

REPO = Path(__file__).resolve().parents[1]
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _kafka_url(infra_env: dict[str, str], tag: str) -> str:
    return f"kafka://{infra_env['STAGETREE_BOOTSTRAP_SERVERS']}/test-optuna-{tag}-{uuid.uuid4().hex[:10]}."


def _delete_topics(url: str) -> None:
    from kafka_cluster import delete_topics

    servers, _, prefix = url[len("kafka://"):].partition("/")
    assert not delete_topics(servers, prefix)


# ----------------------------------------------------------------------------- Optuna's contract


class TestRunDirJournalStorage(StorageTestCase):
    """Optuna's storage contract on a run directory's embedded log."""

    @pytest.fixture
    def storage(self, tmp_path: Path) -> Iterator[optuna.storages.JournalStorage]:
        storage = journal_storage(tmp_path / "run")
        yield storage
        storage._backend.close()


@pytest.fixture(scope="module")
def kafka_prefix(infra_env: dict[str, str]) -> Iterator[str]:
    """A Kafka URL with a topic prefix of this module's own (its topics deleted afterwards)."""
    url = _kafka_url(infra_env, "contract")
    yield url
    _delete_topics(url)


class TestKafkaJournalStorage(StorageTestCase):
    """Optuna's storage contract on a Kafka topic."""

    @pytest.fixture
    def storage(self, kafka_prefix: str) -> Iterator[optuna.storages.JournalStorage]:
        storage = journal_storage(f"{kafka_prefix}{uuid.uuid4().hex[:8]}.")  # a topic of its own per test
        yield storage
        storage._backend.close()


# ----------------------------------------------------------------------------- restart and processes

# Runs in a new process: optimizes (or only loads) study "journal" on the storage at argv[1],
# then prints the study as canonical JSON. argv[2]: trials to run; argv[3]: TPE seed; argv[4]:
# seconds each trial takes.
CLIENT = r"""
import json, sys, time
import optuna
from stagetree.integration.optuna import journal_storage

optuna.logging.set_verbosity(optuna.logging.WARNING)
url, n_trials, seed, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
storage = journal_storage(url)
study = optuna.create_study(study_name="journal", storage=storage, load_if_exists=True, direction="minimize",
                            sampler=optuna.samplers.TPESampler(seed=seed, n_startup_trials=3))
study.set_user_attr("owner", "test")

def objective(trial):
    x = trial.suggest_float("x", -4.0, 4.0)
    lr = trial.suggest_float("lr", 1e-4, 1e-1, log=True)
    layers = trial.suggest_int("layers", 1, 4)
    act = trial.suggest_categorical("act", ["relu", "gelu", "tanh"])
    trial.set_user_attr("note", f"{act}-{layers}")
    time.sleep(pause)
    for step in range(3):
        trial.report((x - 1.0) ** 2 + step * lr, step)
    if act == "tanh" and layers == 4:
        raise optuna.TrialPruned()
    if trial.number == 4:
        raise ValueError("a failing trial")
    return (x - 1.0) ** 2 + lr * layers

print("ready", flush=True)
study.optimize(objective, n_trials=n_trials, catch=(ValueError,))
print(json.dumps(%s(study), sort_keys=True))
""".replace("%s", "dump")

DUMP = r"""
def dump(study):
    def num(v):
        return None if v is None else repr(float(v))
    return {
        "name": study.study_name,
        "directions": [d.name for d in study.directions],
        "user_attrs": study.user_attrs,
        "trials": [{
            "number": t.number, "state": t.state.name, "params": t.params,
            "distributions": {k: optuna.distributions.distribution_to_json(d) for k, d in t.distributions.items()},
            "values": None if t.values is None else [num(v) for v in t.values],
            "intermediate": {str(k): num(v) for k, v in sorted(t.intermediate_values.items())},
            "user_attrs": t.user_attrs, "system_attrs": t.system_attrs,
            "start": t.datetime_start.isoformat() if t.datetime_start else None,
            "complete": t.datetime_complete.isoformat() if t.datetime_complete else None,
        } for t in study.trials],
    }
"""


def _client(url: str, n_trials: int, seed: int = 0, pause: float = 0.0, **popen: object) -> subprocess.Popen[str]:
    script = "import optuna\n" + DUMP + CLIENT
    return subprocess.Popen([sys.executable, "-c", script, url, str(n_trials), str(seed), str(pause)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)  # type: ignore[call-overload]


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out + err
    return json.loads(out.splitlines()[-1])


def _dump_here(url: str) -> dict:
    namespace: dict = {"optuna": optuna}
    exec(DUMP, namespace)
    study = optuna.load_study(study_name="journal", storage=journal_storage(url))
    try:
        return namespace["dump"](study)
    finally:
        study._storage._backend.close()


@pytest.fixture(params=["run-dir", "kafka"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "run-dir":
        yield str(tmp_path / "run")
        return
    url = _kafka_url(request.getfixturevalue("infra_env"), "restart")
    yield url
    _delete_topics(url)


def test_a_journal_replays_into_the_same_study_after_a_restart(url: str) -> None:
    """Process 1 runs 8 trials (complete, pruned, failed; intermediate values, attributes) and
    exits; a new process replays the journal into exactly the study process 1 saw, and goes on
    with 3 more trials; this process then sees all 11, the first 8 unchanged."""
    first = _finish(_client(url, 8))
    states = {t["state"] for t in first["trials"]}
    assert len(first["trials"]) == 8 and {"COMPLETE", "FAIL"} <= states
    assert first["trials"][4]["state"] == "FAIL" and first["user_attrs"] == {"owner": "test"}

    replayed = _finish(_client(url, 0))  # a new process: load only
    assert replayed == first

    more = _finish(_client(url, 3, seed=1))
    assert len(more["trials"]) == 11 and more["trials"][:8] == first["trials"]
    assert _dump_here(url) == more


def test_processes_share_one_study_and_a_run_directory_chains_the_journal(url: str) -> None:
    """Three processes optimize one study at once: every trial gets its own number and ends;
    in a run directory ``replay verify`` checks the journal's hash chain."""
    procs = [_client(url, 6, seed=i) for i in range(3)]
    results = [_finish(p) for p in procs]
    final = _dump_here(url)
    assert [t["number"] for t in final["trials"]] == list(range(18))
    assert all(t["state"] in ("COMPLETE", "PRUNED", "FAIL") for t in final["trials"])
    assert all(len(r["trials"]) >= 6 for r in results)
    if url.startswith("kafka://"):
        return
    source = open_source(url)
    assert topics.OPTUNA in source.streams and len(source.streams[topics.OPTUNA]) > 18 * 5
    audit = verify(source)
    assert audit.ok, audit.first_failure
    assert "chain correctly" in audit.checks[0]["detail"]


def test_processes_go_on_when_the_owner_of_the_log_is_killed(tmp_path: Path) -> None:
    """The first process owns the run directory's log; two others send their operations to it.
    Killing the owner (SIGKILL) mid-study makes one of the others the owner: both finish, every
    trial number is used once, and the log still verifies."""
    run = tmp_path / "run"
    owner = _client(str(run), 10_000, seed=0, pause=0.01)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
    others = [_client(str(run), 20, seed=i, pause=0.05) for i in (1, 2)]
    for other in others:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # everyone writes through the owner for a while
    assert all(other.poll() is None for other in others), "the others finished before the owner was killed"
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(timeout=30)
    survivors = [_finish(p) for p in others]

    final = _dump_here(str(run))
    numbers = [t["number"] for t in final["trials"]]
    assert numbers == list(range(len(numbers)))
    running = [t["number"] for t in final["trials"] if t["state"] == "RUNNING"]
    assert len(running) <= 1  # at most the owner's trial in flight when it was killed
    assert len(final["trials"]) >= 40 + len(running)
    assert all(len(r["trials"]) >= 20 for r in survivors)
    audit = verify(open_source(run))
    assert audit.ok, audit.first_failure


def test_an_edited_journal_fails_verification(tmp_path: Path) -> None:
    """The journal stream is chained like every stream: editing one value in a JSONL export
    makes ``replay verify`` fail at that record."""
    run = tmp_path / "run"
    storage = journal_storage(run)
    study = optuna.create_study(study_name="s", storage=storage)
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    storage._backend.close()
    from replay.audit import export_log, open_export

    export = tmp_path / "log.jsonl"
    export_log(open_source(run), export)
    assert verify(open_export(export)).ok
    lines = export.read_bytes().splitlines()
    i = next(i for i, line in enumerate(lines) if b'"value":' in line and b'\\"values\\":[' in line)
    record = orjson.loads(lines[i])
    record["value"] = record["value"].replace('"values":[', '"values":[0.0,', 1)
    lines[i] = orjson.dumps(record)
    export.write_bytes(b"\n".join(lines) + b"\n")
    audit = verify(open_export(export))
    assert not audit.ok and audit.first_failure.check == "chain"
    assert topics.OPTUNA in audit.first_failure.detail and audit.first_failure.offset == record["offset"]


# ----------------------------------------------------------------------------- edges


def test_a_log_held_by_a_study_is_waited_for_then_refused(tmp_path: Path) -> None:
    held = EmbeddedLog(tmp_path / "run" / "log")  # what a running `stagetree run` coordinator does
    try:
        started = time.monotonic()
        with pytest.raises(LogLocked, match="could not be reached within 0.5 s"):
            journal_storage(tmp_path / "run", timeout_s=0.5)
        assert time.monotonic() - started >= 0.5
    finally:
        held.close()
    storage = journal_storage(tmp_path / "run", timeout_s=0.5)  # free again
    assert storage.get_all_studies() == []
    storage._backend.close()


def test_a_foreign_record_in_the_journal_stream_is_named(tmp_path: Path) -> None:
    backend = RunDirJournalBackend(tmp_path / "run")
    backend.append_logs([{"op_code": 0, "worker_id": "w", "study_name": "s", "directions": [1]}])
    with SharedEmbeddedLog(tmp_path / "run" / "log") as log:  # a client of the backend's owner
        log.append(topics.OPTUNA, "x", b"[1, 2]")
        log.append(topics.OPTUNA, "x", b"{not json")
    with pytest.raises(JournalDecodeError, match="offset 1: a journal operation must be a JSON object, got list"):
        backend.read_logs(0)
    with pytest.raises(JournalDecodeError, match="offset 2: not JSON"):
        backend.read_logs(2)
    backend.close()


@pytest.mark.parametrize("bad", ["", "redis://localhost:6379", "kafka://", "file://", "kafka://host",
                                 "kafka://127.0.0.1:99999", "kafka://127.0.0.1:9092/a prefix"])
def test_bad_urls_name_the_value(bad: str) -> None:
    with pytest.raises(ValueError, match="`url` is"):
        journal_backend(bad)


def test_a_kafka_url_with_credentials_is_refused_without_showing_them() -> None:
    """The URL is read by the parser replay's sources use (events.kafka_log.parse_kafka_url):
    credentials in it were refused as a bad address, quoting the password."""
    with pytest.raises(ValueError, match="`url` is 'kafka://\\*\\*\\*@127.0.0.1:9092/team-a.', but it must not hold "
                                         "credentials") as info:
        journal_backend("kafka://user:hunter2@127.0.0.1:9092/team-a.")
    assert "hunter2" not in str(info.value)


@pytest.mark.timeout(120)  # a bound of the wait, not a timing
def test_a_kafka_url_where_no_broker_answers_is_named_at_once() -> None:
    """Each storage call waited a minute for the broker before its error."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(KafkaLogError, match=f"no Kafka broker at {address} answered within"):
        journal_backend(f"kafka://{address}/team-a.")


def test_urls_pick_the_backend(tmp_path: Path, infra_env: dict[str, str]) -> None:
    servers = f"{infra_env['STAGETREE_BOOTSTRAP_SERVERS']},127.0.0.1:1"  # one that answers is enough
    kafka = journal_backend(f"kafka://{servers}/team-a.")
    assert isinstance(kafka, KafkaJournalBackend)
    assert (kafka.bootstrap_servers, kafka.topic_prefix) == (servers, "team-a.")
    kafka.close()
    run = journal_backend(f"file://{tmp_path}/run")
    assert isinstance(run, RunDirJournalBackend) and run.run_dir == tmp_path / "run"


def test_missing_optuna_names_the_extra() -> None:
    code = ("import sys; sys.modules['optuna'] = None\n"
            "try:\n    import stagetree.integration.optuna\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert "MissingExtra" in out.stdout and "pip install 'stagetree[optuna]'" in out.stdout, out.stdout + out.stderr

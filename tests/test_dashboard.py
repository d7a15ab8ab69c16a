"""`stagetree dashboard`, in a real headless browser (Debian's Chromium, driven by selenium).

The browser and its driver are installed by the project's own ``infra/browser.sh`` (apt-get, as
root) when missing; the tests skip, printing why, only where that cannot be done.

* a study started with ``stagetree run --dashboard 0`` prints the page's address; the page shows
  the trial table, the stage tree and the learning curves, and its count of finished trials grows
  while the study runs, over server-sent events, without the page ever reloading (a screenshot is
  kept: under the test's tmp dir and in ``.artifacts/``);
* the dashboard of the run's export, and of the same study run on a Kafka deployment, shows the
  same trial table as the dashboard of the run directory;
* a study name, a metric name and a hyper-parameter name holding HTML and script are shown as
  text and never run;
* the secure defaults: loopback only (another ``Host`` is refused), a strict Content-Security-
  Policy, ``replay verify`` only on a same-origin request, no secret in anything served;
* without a browser: the views equal the run's summary.json, decisions read from the log equal
  the tuner's own, and verify on demand.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from kafka_cluster import forget_deployment
from partitioned import as_partitioned, separating
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

from events.codec import decode
from events.hp import Constant, MultiStep
from events.models import TrialSubmitted
from gpu_worker.simulated import CostModel, FormulaCurve, SimulatedTrainer
from projections.queries import study_decisions
from replay.audit import export_log, open_source
from stagetree.dashboard import LiveProjection, open_dashboard_source, study_view
from stagetree.simulate import SimStudy, simulate
from stagetree.tuners import ASHA, GridSearch, GridSearchSpace

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "tests" / "studies" / "dashboard_grid.py"
ARTIFACTS = ROOT / ".artifacts"
TRIALS = 8  # the study's grid
BROWSER = os.environ.get("STAGETREE_CHROMIUM", "/usr/bin/chromium")
DRIVER = os.environ.get("STAGETREE_CHROMEDRIVER", "/usr/bin/chromedriver")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


# ----------------------------------------------------------------------------- processes


class Proc:
    """A child process whose output lines are collected by a thread (so it never blocks)."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.popen = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = re.search(pattern, line)
                if match:
                    return match
            if self.popen.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} (exit {self.popen.poll()}):\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._reader.join(timeout=5)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


@contextlib.contextmanager
def dashboard(source: str | Path, env: dict[str, str] | None = None, module: str = "stagetree.dashboard"
              ) -> Iterator[tuple[Proc, str]]:
    """``stagetree dashboard SOURCE --port 0`` as a child; yields it and the page's address."""
    args = [sys.executable, "-m", module, *(["dashboard"] if module == "stagetree.cli" else []), str(source),
            "--port", "0"]
    proc = Proc(args, env)
    try:
        url = proc.wait_for(r"^dashboard: (http://127\.0\.0\.1:\d+/)", timeout=120).group(1)
        yield proc, url
    finally:
        proc.stop()


def run_study(out: Path, env: dict[str, str] | None = None, *flags: str) -> Proc:
    return Proc([sys.executable, "-m", "stagetree.cli", "run", str(STUDY), "--workers", "2", "--out", str(out),
                 "--quiet", *flags], env)


# ----------------------------------------------------------------------------- the browser


@pytest.fixture(scope="session")
def chromium() -> tuple[str, str]:
    """Chromium and chromedriver, installed by ``infra/browser.sh`` when missing (apt-get as root);
    skipped, with the script's reason, only where they cannot be installed."""
    proc = subprocess.run(["bash", str(ROOT / "infra" / "browser.sh")], capture_output=True, text=True, timeout=1800)
    if proc.returncode == 3:
        reason = f"no headless browser: {proc.stderr.strip()}"
        print(reason, file=sys.stderr)
        pytest.skip(reason)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return BROWSER, DRIVER


@pytest.fixture(scope="module")
def browser(chromium: tuple[str, str]) -> Iterator[webdriver.Chrome]:
    binary, driver = chromium
    profile = tempfile.mkdtemp(prefix="stagetree-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1500,2300"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    chrome.set_page_load_timeout(60)
    try:
        yield chrome
    finally:
        chrome.quit()
        shutil.rmtree(profile, ignore_errors=True)


PAGE = """
const fig = (key) => {
  const node = document.querySelector('[data-key="' + key + '"] .value');
  return node ? JSON.parse(node.dataset.value) : null;
};
const curves = document.getElementById('curves').data || [];
return {
  finished: fig('finished_trials'),
  trials: fig('trials') ?? null,
  rows: document.querySelectorAll('#trials-table tbody tr').length,
  bars: document.querySelectorAll('#tree .barlayer .point').length,
  curves: curves.filter((t) => t.mode === 'lines+markers' && t.x.length > 0).length,
  curve_paths: document.querySelectorAll('#curves .scatterlayer .trace .js-line').length,
  gantt: document.querySelectorAll('#gantt .barlayer .point').length,
  marker: window.__stagetreeNotReloaded === true,
  navigations: performance.getEntriesByType('navigation').length,
  live: document.getElementById('live-status').textContent,
};
"""

TABLE = """
return [...document.querySelectorAll('#trials-table tbody tr')].map(
  (tr) => [...tr.querySelectorAll('td')].map((td) => [td.dataset.col, td.textContent]));
"""


def page(browser: webdriver.Chrome) -> dict[str, Any]:
    return browser.execute_script(PAGE)


def wait(browser: webdriver.Chrome, ok: Any, timeout: float = 60, what: str = "") -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    state = page(browser)
    while not ok(state):
        assert time.monotonic() < deadline, f"page never showed {what}: {state}"
        time.sleep(0.2)
        state = page(browser)
    return state


def table(browser: webdriver.Chrome, url: str, rows: int) -> list[list[tuple[str, str]]]:
    """The trial table as the page shows it, one list of (column, text) per trial, by trial id."""
    browser.get(url)
    wait(browser, lambda s: s["rows"] == rows and s["finished"] == rows, what=f"{rows} finished trials")
    cells = browser.execute_script(TABLE)
    return sorted(([tuple(c) for c in row] for row in cells), key=lambda row: dict(row)["id"])


SERVER_GONE = re.compile(r"/api/stream - Failed to load resource: net::(ERR_INCOMPLETE_CHUNKED_ENCODING|"
                         r"ERR_CONNECTION_REFUSED|ERR_EMPTY_RESPONSE)")
"""The page's stream cut when its server stops (with the run): the page says so and reconnects."""


def console_errors(browser: webdriver.Chrome) -> list[str]:
    """Errors in the page's console (script errors, CSP violations, failed loads), except its
    stream being cut by a server that stopped."""
    return [e["message"] for e in browser.get_log("browser")
            if e["level"] == "SEVERE" and not SERVER_GONE.search(e["message"])]


def keep_screenshot(browser: webdriver.Chrome, path: Path, name: str) -> Path:
    assert browser.save_screenshot(str(path)), path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copyfile(path, ARTIFACTS / name)
    return path


# ----------------------------------------------------------------------------- a live study


@pytest.fixture(scope="module")
def live(browser: webdriver.Chrome, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The study run with ``--dashboard 0``, watched by the browser while it runs."""
    tmp = tmp_path_factory.mktemp("dashboard-live")
    out = tmp / "run"
    run = run_study(out, None, "--dashboard", "0")
    seen: list[dict[str, Any]] = []
    errors: list[str] = []
    shot = None
    try:
        url = run.wait_for(r"dashboard: (http://127\.0\.0\.1:\d+/)", timeout=300).group(1)
        browser.get(url)
        browser.execute_script("window.__stagetreeNotReloaded = true;")
        while run.popen.poll() is None:
            try:
                state = page(browser)
            except Exception:  # noqa: BLE001 - the page may be mid-update; the next look decides
                continue
            state["t"] = time.monotonic()
            seen.append(state)
            errors += console_errors(browser)  # while the study runs (the page loses its server after)
            if shot is None and state["finished"] and 2 <= state["finished"] < TRIALS and state["curves"]:
                shot = keep_screenshot(browser, tmp / "dashboard-live.png", "dashboard-live.png")
            time.sleep(0.2)
        final = page(browser)
    finally:
        run.stop()
    assert run.popen.returncode == 0, run.output
    return {"out": out, "url": url, "seen": seen, "final": final, "shot": shot, "errors": errors,
            "output": run.output}


def test_run_with_dashboard_prints_a_loopback_address(live: dict[str, Any]) -> None:
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", live["url"])
    assert "stops with the run" in live["output"]


def test_page_shows_table_tree_and_curves_while_the_study_runs(live: dict[str, Any]) -> None:
    running = [s for s in live["seen"] if s["finished"] is not None and 0 < s["finished"] < TRIALS]
    assert running, f"the page never showed the study part-way: {live['seen'][-3:]}"
    assert any(s["rows"] == TRIALS and s["bars"] > 0 and s["curves"] > 0 and s["curve_paths"] > 0
               and s["gantt"] > 0 for s in running), running[-1]
    assert all(s["live"].startswith("live") for s in running)


def test_finished_trials_grow_on_the_page_without_a_reload(live: dict[str, Any]) -> None:
    counts = [s["finished"] for s in live["seen"] if s["finished"] is not None]
    assert counts == sorted(counts), counts  # never goes back
    distinct = sorted(set(counts))
    assert len(distinct) >= 3 and distinct[-1] > distinct[0], counts  # it grew, step by step
    assert all(s["marker"] and s["navigations"] == 1 for s in live["seen"] + [live["final"]])
    assert not live["errors"], live["errors"]  # no script error, no CSP violation


def test_a_screenshot_of_the_running_study_is_kept(live: dict[str, Any]) -> None:
    shot = live["shot"]
    assert shot is not None and shot.stat().st_size > 50_000
    assert (ARTIFACTS / "dashboard-live.png").read_bytes() == shot.read_bytes()


# ----------------------------------------------------------------------------- the same table everywhere


@pytest.fixture(scope="module")
def run_dir_table(live: dict[str, Any], browser: webdriver.Chrome, tmp_path_factory: pytest.TempPathFactory
                  ) -> list[list[tuple[str, str]]]:
    tmp = tmp_path_factory.mktemp("dashboard-finished")
    with dashboard(live["out"]) as (_, url):
        rows = table(browser, url, TRIALS)
        keep_screenshot(browser, tmp / "dashboard-finished.png", "dashboard-finished.png")
    return rows


def test_finished_run_table_equals_its_summary(run_dir_table: list[list[tuple[str, str]]],
                                               live: dict[str, Any]) -> None:
    summary = orjson.loads((live["out"] / "summary.json").read_bytes())
    expected = {t["trial_id"]: t for t in summary["trials"]}
    assert [dict(row)["id"] for row in run_dir_table] == sorted(expected)
    for row in map(dict, run_dir_table):
        trial = expected[row["id"]]
        assert row["status"] == trial["status"] == "done"
        assert int(row["steps"].replace(",", "")) == trial["steps"] == 120
        assert float(row["metric"]) == pytest.approx(trial["metrics"]["val_acc"], abs=5e-5)
        assert row["hp:lr"] and row["hp:momentum"]


def test_export_dashboard_shows_the_same_table(run_dir_table: list[list[tuple[str, str]]], live: dict[str, Any],
                                               browser: webdriver.Chrome, tmp_path: Path) -> None:
    export = tmp_path / "dash.jsonl"
    export_log(open_source(live["out"]), export)  # what `stagetree log export` writes
    with dashboard(export) as (_, url):
        assert table(browser, url, TRIALS) == run_dir_table
        assert page(browser)["live"].startswith("export")


def test_kafka_deployment_dashboard_shows_the_same_table(run_dir_table: list[list[tuple[str, str]]],
                                                         infra_env: dict[str, str], browser: webdriver.Chrome,
                                                         tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:10]
    prefix = f"test-dashboard-{tag}."
    env = {**os.environ, **infra_env, "STAGETREE_TOPIC_PREFIX": prefix,
           "STAGETREE_CHECKPOINT_STORE": f"s3://stagetree/test-dashboard-{tag}"}
    try:
        # The study on the deployment, with its dashboard beside it (a plain consumer of the topics).
        run = run_study(tmp_path / "kafka", env, "--dashboard", "0")
        beside = run.wait_for(r"dashboard: (http://127\.0\.0\.1:\d+/)", timeout=300).group(1)
        progress = []
        while run.popen.poll() is None:
            try:
                view = json.loads(fetch(beside, "/api/view")[2])["view"]
            except OSError:
                break  # it stops with the run
            if view is not None:
                progress.append(view["figures"]["finished_trials"])
            time.sleep(0.5)
        run.popen.wait(timeout=900)
        run.stop()
        assert run.popen.returncode == 0, run.output
        assert any(0 < n for n in progress), progress  # the deployment's trials showed up as they finished
        with dashboard(f"kafka://{env['STAGETREE_BOOTSTRAP_SERVERS']}/{prefix}", env) as (_, url):
            assert table(browser, url, TRIALS) == run_dir_table
    finally:
        forget_deployment(env)


# ----------------------------------------------------------------------------- data is text


HOSTILE_NAME = '<img src=x onerror="window.__xss=1">Study "A" & <b>B</b>'
HOSTILE_METRIC = "<script>window.__xss=2</script><b>acc</b><br>&amp;"
HOSTILE_HP = '<svg onload="window.__xss=3">lr'


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated study whose name, metric name and hyper-parameter name hold HTML and script."""
    curve = FormulaCurve(lambda values, step: {HOSTILE_METRIC: step / 100 * values[HOSTILE_HP]})
    trainer = SimulatedTrainer("hostile", (HOSTILE_HP,), cost=CostModel(1.0), curve=curve)
    space = GridSearchSpace({HOSTILE_HP: [Constant(0.5), MultiStep(0.5, (5,), 2.0), Constant(0.25)]})
    out = tmp_path_factory.mktemp("hostile") / "run"
    simulate(trainer, [SimStudy(HOSTILE_NAME, GridSearch(space, 10, HOSTILE_METRIC))], workers=2, run_dir=out)
    return out


def test_html_in_study_metric_and_hyperparameter_names_is_shown_as_text(hostile_run: Path,
                                                                       browser: webdriver.Chrome) -> None:
    with dashboard(hostile_run) as (_, url):
        browser.get(url)
        wait(browser, lambda s: s["rows"] == 3 and s["curves"] == 3, what="the hostile study")
        shown = browser.execute_script("""
            return {
              xss: window.__xss === undefined ? null : window.__xss,
              name: document.getElementById('study-name').textContent,
              option: document.querySelector('#study-select option').textContent,
              title: document.title,
              metric: document.querySelector('th[data-col="metric"]').textContent,
              hp: [...document.querySelectorAll('th')].map((th) => th.textContent),
              ytitle: document.querySelector('#curves .g-ytitle').textContent,
              injected: document.querySelectorAll('img, [onload], [onerror], script:not([src])').length
                + [...document.querySelectorAll('b')].filter((b) => b.textContent === 'B').length,
            };""")
        assert shown["xss"] is None
        assert shown["name"] == HOSTILE_NAME
        assert shown["option"].startswith(HOSTILE_NAME)
        assert shown["title"] == "stagetree · " + HOSTILE_NAME
        assert shown["metric"] == HOSTILE_METRIC
        assert HOSTILE_HP in shown["hp"]
        assert shown["ytitle"] == HOSTILE_METRIC  # Plotly drew the escaped text as the text itself
        assert shown["injected"] == 0
        # Hovering and selecting draw the names into Plotly labels and the selection panel.
        browser.execute_script("document.querySelector('#trials-table tbody tr').click();")
        time.sleep(0.5)
        assert browser.execute_script("return window.__xss === undefined")
        assert HOSTILE_HP in browser.execute_script("return document.getElementById('selected').textContent")
        assert not console_errors(browser)


# ----------------------------------------------------------------------------- secure defaults (no browser)


def fetch(url: str, path: str, method: str = "GET", headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    host, port = re.match(r"http://([^:/]+):(\d+)/", url).groups()  # type: ignore[union-attr]
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, headers=headers or {})
        response = conn.getresponse()
        if path.startswith("/api/stream"):
            body = b""
            while b"\n\n" not in body:
                body += response.read1(65536)
        else:
            body = response.read()
        return response.status, dict(response.getheaders()), body
    finally:
        conn.close()


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (path -> hex digest)."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_secure_defaults(live: dict[str, Any]) -> None:
    before = tree_digest(live["out"])
    secrets = {"STAGETREE_LOG_KEY": "log-key-" + uuid.uuid4().hex,
               "STAGETREE_KAFKA_SASL_PASSWORD": "sasl-" + uuid.uuid4().hex,
               "STAGETREE_S3_SECRET_KEY": "s3-" + uuid.uuid4().hex}
    with dashboard(live["out"], {**os.environ, **secrets}, module="stagetree.cli") as (proc, url):
        served = b""
        for path in ("/", "/static/dashboard.js", "/static/dashboard.css", "/api/view", "/api/stream"):
            status, headers, body = fetch(url, path)
            assert status == 200, (path, status)
            assert "script-src 'self'" in headers["Content-Security-Policy"]
            assert "unsafe-eval" not in headers["Content-Security-Policy"]
            assert headers["X-Content-Type-Options"] == "nosniff" and headers["X-Frame-Options"] == "DENY"
            served += body
        # DNS rebinding: a page of another site resolving its name to 127.0.0.1 is refused.
        assert fetch(url, "/api/view", headers={"Host": "evil.example:80"})[0] == 421
        assert fetch(url, "/api/view", headers={"Host": "localhost"})[0] == 200
        # verify runs only on a request a page of another origin cannot make without asking.
        assert fetch(url, "/api/verify", "POST")[0] == 403
        status, _, body = fetch(url, "/api/verify", "POST", {"X-Stagetree-Request": "verify"})
        assert status == 200
        audit = json.loads(body)
        # The run was written without a key and the dashboard was handed one: verify says so,
        # naming no secret.
        assert audit["ok"] is False and "secret" in audit["first_failure"]
        served += body + fetch(url, "/api/view")[2]
        for value in secrets.values():
            assert value.encode() not in served
            assert value not in proc.output
    assert tree_digest(live["out"]) == before  # read-only: not a byte of the run directory changed


# ----------------------------------------------------------------------------- the views, without a browser


def test_views_equal_the_summary_and_verify_passes(live: dict[str, Any]) -> None:
    summary = orjson.loads((live["out"] / "summary.json").read_bytes())
    source = open_dashboard_source(str(live["out"]))
    try:
        projection = LiveProjection()
        projection.fold(source.poll())
        assert source.poll() == []  # nothing new: the run is over
        view = study_view(projection, "dash", source.label)
        audit = source.verify()
    finally:
        source.close()
    figures = view["figures"]
    for key in ("merge_rate", "total_steps", "unique_steps", "executed_steps", "worker_seconds",
                "end_to_end_seconds", "idle_worker_seconds", "best_trial", "best_metric", "best_step"):
        assert figures[key] == pytest.approx(summary[key]), key
    assert figures["finished_trials"] == figures["trials"] == TRIALS
    assert figures["delivered_steps"] == summary["total_steps"]
    assert figures["saved_worker_seconds"] == pytest.approx(
        summary["worker_seconds"] * (summary["total_steps"] / summary["executed_steps"] - 1))
    assert summary["merge_rate"] > 1 and figures["shared_stages"] > 0
    assert sum(s["to"] - s["from"] for s in view["tree"]) == summary["executed_steps"]  # each stage once
    assert {r["worker"] for r in view["gantt"]} == {"w0", "w1"}
    assert all(r["status"] == "finished" for r in view["gantt"])
    assert audit["ok"], audit
    # every check of `stagetree replay verify`, the tuner's decisions recomputed included
    assert [c["name"] for c in audit["checks"]] == ["chain", "decision", "projection", "checkpoint", "tuner"], audit
    assert "recomputed" in audit["checks"][-1]["detail"], audit
    assert "stored projection" in audit["scope"]
    # the anchor of what was verified (the run's own: its projection holds the whole log) and the tuner
    assert audit["anchor"] == summary["log_anchor"], audit
    assert view["study"]["tuner"].startswith("GridWithCurves(") and view["study"]["tuner"].endswith(", rules 1")


def test_decisions_read_from_the_log_equal_the_tuners_own(tmp_path: Path) -> None:
    trainer = SimulatedTrainer("toy", ("lr",), cost=CostModel(1.0))
    space = GridSearchSpace({"lr": [Constant(v) for v in (0.01, 0.03, 0.1, 0.3, 1.0, 0.05, 0.2, 0.5)]})
    result = simulate(trainer, [SimStudy("asha", ASHA(space, "val_acc", min_steps=4, max_steps=64, reduction=2))],
                      workers=3, run_dir=tmp_path / "run")
    (tuner,) = result.results
    source = open_dashboard_source(str(tmp_path / "run"))
    try:
        projection = LiveProjection()
        projection.fold(source.poll())
    finally:
        source.close()
    state = projection.state
    decisions = study_decisions(state, "asha", projection.promotions)
    promotions = {("promote", trial, d.step, d.to_steps) for trial, ds in decisions.items() for d in ds
                  if d.kind == "promote"}
    assert promotions == {("promote", d.trial_id, d.step, d.to_step) for d in tuner.decisions if d.kind == "promote"}
    assert {d.source for ds in decisions.values() for d in ds} == {"tuner"}  # the typed decisions of the log
    assert promotions  # the study did promote
    stopped = {(trial, d.step) for trial, ds in decisions.items() for d in ds if d.kind == "stop"}
    assert stopped == {(d.trial_id, d.step) for d in tuner.decisions if d.kind == "stop"}
    assert len({trial for trial, _ in stopped}) == len(state.trials)  # ASHA stops every trial at its last rung
    view = study_view(projection, "asha")
    assert {m["kind"] for m in view["curves"]["marks"]} == {"promote", "stop"}
    decision = {r["id"]: r["decision"] for r in view["trials"]}
    best = tuner.best.trial_id
    assert decision[best] == f"stopped at step {max(state.trials[best].results)}"


def test_a_partitioned_plan_stream_shows_as_the_same_studies(tmp_path: Path) -> None:
    """The plan stream of a Kafka deployment (several partitions, the worker events in each)
    folds into the same views as the same events in one stream."""
    trainer = SimulatedTrainer("toy", ("lr",), cost=CostModel(1.0))
    space = GridSearchSpace({"lr": [Constant(0.1), MultiStep(0.1, (8,), 0.1), MultiStep(0.1, (16,), 0.5),
                                    Constant(0.05)]})
    simulate(trainer, [SimStudy("alpha", ASHA(space, "val_acc", min_steps=4, max_steps=32, reduction=2), seed=1),
                       SimStudy("beta", GridSearch(space, 24, "val_acc"), seed=2)], workers=2,
             run_dir=tmp_path / "run")
    records = open_source(tmp_path / "run").streams["stagetree.plan"]
    one, parts = LiveProjection(), LiveProjection()
    one.fold(records)
    keys = {e.plan_key for e in map(decode, (r.value for r in records)) if isinstance(e, TrialSubmitted)}
    assert len(keys) == 2
    spread = as_partitioned(records, separating(keys))  # the two plans in two partitions, the others empty
    parts.fold(spread[:len(spread) // 2])  # in two polls, as a live source hands them out
    parts.fold(spread[len(spread) // 2:])
    assert sorted(e.event_id for _, e in parts.events) == sorted(e.event_id for _, e in one.events)
    for study in ("alpha", "beta"):
        view, again = study_view(one, study), study_view(parts, study)
        assert {k: v for k, v in again.items() if k != "log"} == {k: v for k, v in view.items() if k != "log"}
        assert again["trials"] and again["tree"] and again["gantt"]
    assert any(row["decision"] for row in study_view(parts, "alpha")["trials"])  # ASHA's, from its partition


# ----------------------------------------------------------------------------- studies, sorting, selecting, verify


@pytest.fixture(scope="module")
def two_studies(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two simulated studies on one plan in one run directory (the second shares the first's steps)."""
    trainer = SimulatedTrainer("toy", ("lr",), cost=CostModel(1.0))
    space = GridSearchSpace({"lr": [Constant(0.1), MultiStep(0.1, (8,), 0.1), MultiStep(0.1, (16,), 0.5),
                                    Constant(0.05)]})
    out = tmp_path_factory.mktemp("two-studies") / "run"
    simulate(trainer, [SimStudy("alpha", ASHA(space, "val_acc", min_steps=4, max_steps=32, reduction=2)),
                       SimStudy("beta", GridSearch(space, 24, "val_acc"))], workers=2, run_dir=out)
    return out


def test_a_finished_studys_figures_are_its_summarys_whatever_a_later_study_added(tmp_path: Path) -> None:
    """Two studies run one after the other into one directory, on one plan: the later one trains
    that plan further, after the earlier one ended. The earlier study's figures are those of its
    summary file, written at its end, not the plan's as it is now (which mixed the later
    study's steps and seconds in)."""
    from projections.summary import summary_path

    examples = ROOT / "examples"
    out = tmp_path / "run"
    for name, steps in (("early", 2), ("late", 4)):
        study = tmp_path / f"{name}.py"
        study.write_text(f"import sys\nsys.path.insert(0, {str(examples)!r})\nfrom digits import DigitsTrainer\n"
                         "from stagetree import GridSearch, GridSearchSpace\ntrainer = DigitsTrainer()\n"
                         'tuner = GridSearch(GridSearchSpace({"lr": [0.1], "batch_size": [32], "momentum": [0.0]}), '
                         f'steps={steps}, metric="val_acc")\nname = {name!r}\n')
        proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(study), "--workers", "1", "--out",
                               str(out), "--quiet"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    source = open_dashboard_source(str(out))
    try:
        projection = LiveProjection()
        projection.fold(source.poll())
        views = {s: study_view(projection, s, source.label)["figures"] for s in ("early", "late")}
    finally:
        source.close()
    for study, figures in views.items():
        summary = orjson.loads(summary_path(out, study).read_bytes())
        for key in ("executed_steps", "worker_seconds", "idle_worker_seconds", "k_wise_merge_rate"):
            assert figures[key] == pytest.approx(summary[key]), (study, key)
    assert views["early"]["executed_steps"] == 2 and views["late"]["executed_steps"] == 4
    assert views["early"]["saved_worker_seconds"] >= 0
    # "late" delivered 4 steps and trained 2 of them (the first 2 were early's): it saved half of
    # what 4 steps cost at the plan's rate (it read 0 or less: the plan's seconds were all its cost)
    late = views["late"]
    assert late["saved_worker_seconds"] == pytest.approx(late["worker_seconds"] / 4 * (4 - 2))


def test_studies_are_selectable_and_trials_sortable_clickable_and_verifiable(two_studies: Path,
                                                                            browser: webdriver.Chrome) -> None:
    with dashboard(two_studies) as (_, url):
        browser.get(url)
        wait(browser, lambda s: s["rows"] == 4 and s["curves"] == 4, what="the last study started")
        browser.execute_script("window.__stagetreeNotReloaded = true;")
        options = browser.execute_script(
            "return [...document.querySelectorAll('#study-select option')].map((o) => [o.value, o.textContent]);")
        assert [value for value, _ in options] == ["alpha", "beta"]
        assert browser.execute_script("return document.getElementById('study-select').value") == "beta"
        assert browser.execute_script("return document.getElementById('study-name').textContent") == "beta"

        # Pick the other study: the stream is reopened, the page is not.
        browser.execute_script("""
            const select = document.getElementById('study-select');
            select.value = 'alpha';
            select.dispatchEvent(new Event('change'));""")
        wait(browser, lambda s: s["rows"] == 4 and s["marker"], what="study alpha")
        deadline = time.monotonic() + 30
        while browser.execute_script("return document.getElementById('study-name').textContent") != "alpha":
            assert time.monotonic() < deadline, "the page never showed study alpha"
            time.sleep(0.2)
        assert browser.execute_script("return window.location.search") == "?study=alpha"
        assert page(browser)["navigations"] == 1 and page(browser)["marker"]
        marks = browser.execute_script(
            "return document.getElementById('curves').data.filter((t) => t.mode === 'markers')"
            ".map((t) => [t.name, t.x.length]);")
        assert dict(marks)["promoted"] > 0 and dict(marks)["stopped"] > 0  # ASHA promoted and stopped

        # Sort by trial id, both ways.
        ids = "return [...document.querySelectorAll('#trials-table tbody tr')].map((tr) => tr.dataset.trial);"
        browser.execute_script("document.querySelector('th[data-col=\"id\"]').click();")
        ascending = browser.execute_script(ids)
        assert ascending == sorted(ascending)
        browser.execute_script("document.querySelector('th[data-col=\"id\"]').click();")
        assert browser.execute_script(ids) == sorted(ascending, reverse=True)
        browser.execute_script("document.querySelector('th[data-col=\"steps\"]').click();")
        steps = browser.execute_script(
            "return [...document.querySelectorAll('#trials-table tbody td[data-col=\"steps\"]')]"
            ".map((td) => +td.textContent);")
        assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]

        # Click a trial's curve: it is selected everywhere.
        chosen = ascending[1]
        browser.execute_script("document.getElementById('curves').emit('plotly_click', "
                               "{points: [{customdata: arguments[0]}]});", chosen)
        selected = browser.execute_script("""return {
            panel: document.querySelector('#selected .id').textContent,
            row: document.querySelector('#trials-table tr.selected').dataset.trial,
            outlined: document.getElementById('tree').data[1].marker.line.width.filter((w) => w > 1).length,
            path: [...document.querySelectorAll('#selected div')].pop().textContent};""")
        assert selected["panel"] == selected["row"] == chosen
        assert selected["outlined"] > 0 and selected["path"].startswith("path: n")

        # Hover shows the values; a zoom survives the updates that follow (here: the audit's).
        hover = browser.execute_script("""
            const tree = document.getElementById('tree');
            Plotly.Fx.hover(tree, [{curveNumber: 1, pointNumber: 0}]);
            const label = tree.querySelector('.hoverlayer .hovertext');
            return label ? label.textContent : null;""")
        first = browser.execute_script("return document.getElementById('tree').data[1].hovertext[0]")
        assert hover and hover.startswith(first.split(" · ")[0]) and "steps [" in hover, (hover, first)
        browser.execute_script("Plotly.relayout('curves', {'xaxis.range': [5, 9]});")

        # replay verify on demand.
        browser.execute_script("document.getElementById('verify-button').click();")
        deadline = time.monotonic() + 120
        while not browser.execute_script("return document.getElementById('audit-status').textContent")\
                .startswith("passed"):
            assert time.monotonic() < deadline, browser.execute_script(
                "return document.getElementById('audit').textContent")
            time.sleep(0.3)
        checks = browser.execute_script("return document.getElementById('audit-checks').textContent")
        assert "ok chain" in checks and "ok decision" in checks and "ok projection" in checks
        assert browser.execute_script("return document.getElementById('curves').layout.xaxis.range") == [5, 9]
        assert not console_errors(browser)


# ----------------------------------------------------------------------------- bad input


def test_a_busy_dashboard_port_is_refused_before_the_run_creates_anything(tmp_path: Path) -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = tmp_path / "run"
        proc = subprocess.run([sys.executable, "-m", "stagetree.cli", "run", str(STUDY), "--out", str(out),
                               "--quiet", "--dashboard", str(port)], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"--dashboard {port}" in proc.stderr and "cannot listen" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize(("source", "why"), [
    ("kafka://user:hunter2@127.0.0.1:9092", "credentials"),
    ("kafka://127.0.0.1", "HOST:PORT"),
    ("not-an-export.txt", "line 1: not JSON"),
    ("a-directory", "not a run directory"),
])
def test_a_source_that_is_not_a_study_is_refused_by_name(source: str, why: str, tmp_path: Path) -> None:
    if source == "not-an-export.txt":
        (tmp_path / source).write_text("hello\n")
    if source == "a-directory":
        (tmp_path / source).mkdir()
        (tmp_path / source / "notes.txt").write_text("not a run\n")
    proc = subprocess.run([sys.executable, "-m", "stagetree.dashboard", source, "--port", "0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert why in proc.stderr and "hunter2" not in proc.stderr
    assert proc.stdout == ""  # it never listened


@pytest.mark.parametrize("host", ["nosuchhost.invalid", "10.255.255.1"])
def test_a_host_that_cannot_be_listened_on_is_named_not_the_port(host: str) -> None:
    """A name that does not resolve, or an address not this machine's: the error names --host."""
    from stagetree.dashboard.cli import DashboardError, listen

    with pytest.raises(DashboardError, match=f"^--host {re.escape(host)}: cannot listen"):
        listen(host, 0)


def test_a_run_directory_that_does_not_exist_is_waited_for_with_a_warning(tmp_path: Path) -> None:
    """A run about to start, or a mistyped path: the dashboard serves the directory when a run
    writes its log there, and says at once that it does not exist yet."""
    with dashboard(tmp_path / "not-yet") as (proc, url):
        proc.wait_for(r"warning: .*not-yet does not exist \(yet\)", timeout=30)
        assert fetch(url, "/api/view")[0] == 200

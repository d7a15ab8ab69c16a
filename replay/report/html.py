"""The report's HTML: the audit, the merge-savings table, the trial table (every string escaped)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from projections.state import Trial
from replay.report.load import RunData
from replay.report.tree import TreeStage
from stagetree.words import counted

# ----------------------------------------------------------------------------- HTML

CSS = """
body{font-family:-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;background:#f6f7f9;color:#1f2328}
main{max-width:1180px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:1.6em;margin:0 0 4px} h2{font-size:1.2em;margin:0 0 10px}
.meta{color:#57606a;font-size:.9em;margin:0 0 18px}
section{background:#fff;border:1px solid #d8dee4;border-radius:8px;padding:16px 20px;margin:0 0 18px}
.audit{border-width:2px}
.audit.ok{background:#e9f7ef;border-color:#2da44e} .audit.ok h2{color:#1a7f37}
.audit.fail{background:#fdecec;border-color:#cf222e} .audit.fail h2{color:#cf222e}
.audit.none{background:#fff8e5;border-color:#d4a72c} .audit.none h2{color:#9a6700}
.audit ul{margin:8px 0 0;padding-left:20px} .audit li{margin:2px 0}
.first{font-weight:600}
code{background:#eff1f3;padding:1px 5px;border-radius:4px;font-size:.92em}
table{border-collapse:collapse;font-size:.92em}
th,td{border-bottom:1px solid #e4e7eb;padding:5px 12px;text-align:left;vertical-align:top}
th{background:#f3f5f7;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
td.note{color:#57606a}
tr.best td{background:#fff4e0;font-weight:600}
img{max-width:100%;height:auto;display:block;margin:6px 0}
.caption{color:#57606a;font-size:.88em;margin:4px 0 0}
.swatch{display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:middle;margin-right:3px}
.trials{max-height:520px;overflow:auto}
.hp{font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:.85em;color:#333}
"""


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: Any, fmt: str = "{:,}") -> str:
    if v is None:
        return "—"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return fmt.format(v)


def audit_html(audit: dict[str, Any] | None) -> str:
    """The audit banner: green when ``audit["ok"]``, red with the first failure otherwise, amber
    "not audited" when ``audit`` is None. ``audit`` is ``stagetree replay verify --json``'s
    document: {"ok", "checks": [{"name", "ok", "skipped", "detail"}], "first_failure", "anchor"}
    (a skipped check, not made, is marked as such; the anchor is shown when the audit passed)."""
    if audit is None:
        return ('<section class="audit none" id="audit"><h2>Not audited</h2>'
                "<p>not audited — run <code>stagetree replay verify</code> on this run (or "
                "<code>stagetree report SOURCE --verify</code>) to check the hash chain, every "
                "scheduling decision, the projections and the checkpoints.</p></section>")
    ok = bool(audit.get("ok"))
    checks = audit.get("checks") or []
    parts = [f'<section class="audit {"ok" if ok else "fail"}" id="audit">']
    if ok:
        skipped = [c.get("name", "?") for c in checks if isinstance(c, dict) and c.get("skipped")]
        made = f" made; not made: {_e(', '.join(map(str, skipped)))} (below)" if skipped else ""
        parts.append("<h2>&#10004; Audit passed</h2>"
                     f"<p>Every check of <code>stagetree replay verify</code>{made} matched.</p>")
    else:
        first = audit.get("first_failure") or next(
            (f"{c.get('name')}: {c.get('detail')}" for c in checks if isinstance(c, dict) and not c.get("ok")),
            "unknown failure")
        parts.append(f'<h2>&#10008; Audit FAILED</h2><p class="first">First failure: {_e(first)}</p>')
    if checks:
        parts.append("<ul>")
        for c in checks:
            if not isinstance(c, dict):
                continue
            mark = "&#8212; skipped" if c.get("skipped") else "&#10004;" if c.get("ok") else "&#10008;"
            parts.append(f"<li>{mark} <b>{_e(c.get('name', '?'))}</b>: {_e(c.get('detail', ''))}</li>")
        parts.append("</ul>")
    if audit.get("events") is not None:
        parts.append(f'<p class="caption">{_e(audit["events"])} records checked.</p>')
    if ok and audit.get("anchor"):
        parts.append(f'<p class="caption">Anchor of the log audited: <code>{_e(audit["anchor"])}</code>. Kept apart '
                     "from the log, <code>stagetree replay verify --anchor</code> proves later that the log still "
                     "holds this record, with everything before it unchanged.</p>")
    parts.append("</section>")
    return "".join(parts)


SAVINGS_ROWS: tuple[tuple[str, str, str], ...] = (
    ("total_steps", "Total steps", "sum of every trial's steps, as if each trained alone"),
    ("unique_steps", "Unique steps", "steps of the union of the trials' prefixes if merged"),
    ("executed_steps", "Executed steps", "steps workers actually trained (finished stages)"),
    ("merge_rate", "Merge rate p", "total / unique (Hippo §6.2)"),
    ("worker_seconds", "Worker-seconds", "time workers were held by stages (the papers' GPU-hours)"),
    ("end_to_end_seconds", "End-to-end seconds", "wall time from a ready cluster to the answer"),
    ("checkpoint_bytes", "Checkpoint bytes kept", "checkpoint objects the run keeps at the end (all studies)"),
    ("peak_checkpoint_bytes", "Peak checkpoint bytes", "the most checkpoint bytes kept at once"),
    ("checkpoints_evicted", "Checkpoints evicted", "evicted to stay within a checkpoint budget"),
)


def savings_html(data: RunData, stages: Sequence[TreeStage], trials: Sequence[Trial]) -> str:
    """The merge-savings table. Every value cell carries ``data-key`` and ``data-value`` (the
    exact JSON value from the summary) so tools and tests can read it back."""
    s = data.summary
    if s is None:
        return ('<section id="savings"><h2>Merge savings</h2><p>No summary: the log names no study.</p>'
                "</section>")
    fmt = {"merge_rate": "{:.3f}", "worker_seconds": "{:,.2f}", "end_to_end_seconds": "{:,.2f}"}
    rows = []

    def row(key: str, label: str, value: Any, shown: str, note: str) -> None:
        rows.append(f'<tr><th>{_e(label)}</th><td class="num" data-key="{_e(key)}" '
                    f'data-value="{_e(json.dumps(value))}">{_e(shown)}</td><td class="note">{_e(note)}</td></tr>')

    for key, label, note in SAVINGS_ROWS:
        v = s.get(key)
        row(key, label, v, _num(v, fmt.get(key, "{:,}")), note)
    idle, ratio = idle_figures(s)
    row("idle_worker_seconds", "Idle worker-seconds", idle, _num(idle, "{:,.2f}"),
        "idle worker time (includes causal-order waiting, if the tuner used it): "
        "workers × end-to-end − worker-seconds")
    row("idle_ratio", "Idle ratio", ratio, "—" if ratio is None else f"{100 * ratio:.1f}%",
        "idle worker-seconds / (workers × end-to-end)")
    total, executed = s.get("total_steps"), s.get("executed_steps")
    if isinstance(total, int) and isinstance(executed, int) and total:
        saved = total - executed
        row("saved_steps", "Steps saved", saved, f"{saved:,} ({100 * saved / total:.1f}%)",
            "total − executed: training merging avoided")
    shared = sum(st.shared for st in stages)
    row("shared_stages", "Shared stages", shared, f"{shared} of {len(stages)}",
        "executed stages on the path of 2+ trials")
    if s.get("best_trial") is not None:
        row("best_trial", "Best trial", s.get("best_trial"), str(s.get("best_trial")), "the tuner's answer")
        step = s.get("best_step")  # None in a summary written before the key
        row("best_metric", "Best metric", s.get("best_metric"), _num(s.get("best_metric"), "{:.4f}"),
            "its metric where the tuner chose it" if step is None
            else f"its metric at step {step}, where the tuner chose it")
    sim = (f" Simulated by <code>stagetree simulate</code> ({_e(s.get('policy') or 'critical-path')} policy): "
           "seconds are virtual seconds of simulated GPUs, timed by the trainer's cost model."
           if data.simulated else "")
    head = (f"<p class=\"caption\">{_e(s.get('name', ''))}: {_e(s.get('mode', '?'))} mode, "
            f"{_e(counted(s.get('workers', '?'), 'worker'))}, {_e(counted(len(trials), 'trial'))}; "
            f"values {_e(data.summary_source)}.{sim}</p>")
    return (f'<section id="savings"><h2>Merge savings</h2>{head}<table>'
            f"<tr><th>quantity</th><th>value</th><th>meaning</th></tr>{''.join(rows)}</table></section>")


def idle_figures(summary: dict[str, Any]) -> tuple[float | None, float | None]:
    """``(idle_worker_seconds, idle_ratio)`` of a summary: the summary's own idle seconds (else
    max(0, workers x end-to-end - worker-seconds), for summaries written before it existed) and
    idle / (workers x end-to-end); None where the figures are missing or the denominator is 0."""
    workers, e2e, held = summary.get("workers"), summary.get("end_to_end_seconds"), summary.get("worker_seconds")
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (workers, e2e, held))
    capacity = workers * e2e if numbers else None  # type: ignore[operator]
    idle = summary.get("idle_worker_seconds")
    if not isinstance(idle, (int, float)) or isinstance(idle, bool):
        idle = max(0.0, capacity - held) if capacity is not None else None  # type: ignore[operator]
    ratio = idle / capacity if idle is not None and capacity else None
    return idle, ratio


def trials_html(trials: Sequence[Trial], metric: str | None, best: str | None,
                decisions: Mapping[str, str] | None = None) -> str:
    """A table of the trials: id, status, steps, final metric, the tuner's final decision about
    it and why (``decisions``: trial id -> its text, e.g. "step 10: stopped by
    SuccessiveHalving, rung 0: rank 13 of 16 by val_acc 0.5312, top 8 kept (threshold
    0.6094)"), hyper-parameters (best first)."""
    if not trials:
        return ""
    decisions = decisions or {}

    def final(t: Trial) -> Any:
        return t.results[max(t.results)].get(metric) if t.results and metric else None

    order = sorted(trials, key=lambda t: (t.trial_id != best, -t.steps, t.trial_id))
    rows = []
    for t in order:
        v = final(t)
        hp = "; ".join(f"{k}={fn}" for k, fn in sorted(t.hp.items()))
        cls = ' class="best"' if t.trial_id == best else ""
        status = t.status + (f": {t.error}" if t.error else "")
        decided = decisions.get(t.trial_id, "—")
        rows.append(f"<tr{cls}><td>{_e(t.trial_id)}</td><td>{_e(status)}</td><td class=\"num\">{t.steps:,}</td>"
                    f"<td class=\"num\">{_e(_num(v, '{:.4f}'))}</td><td class=\"note\">{_e(decided)}</td>"
                    f"<td class=\"hp\">{_e(hp)}</td></tr>")
    return (f'<section id="trials"><h2>Trials</h2><div class="trials"><table><tr><th>trial</th><th>status</th>'
            f"<th>steps</th><th>{_e(metric or 'metric')}</th><th>final decision and reason</th>"
            f"<th>hyper-parameters</th></tr>{''.join(rows)}</table></div></section>")


def _figure(section: str, title: str, src: str, alt: str, caption: str) -> str:
    return (f'<section id="{_e(section)}"><h2>{_e(title)}</h2><img src="{_e(src)}" alt="{_e(alt)}">'
            f'<p class="caption">{caption}</p></section>')


def _swatch(color: str) -> str:
    return f'<span class="swatch" style="background:{color}"></span>'

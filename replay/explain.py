"""``stagetree replay explain SOURCE TRIAL_ID [--json]``: one trial's whole story from the log.

In order: the trial's study and status; its configuration (the hyper-parameter sequences) and
its requests (the steps asked, with the offset of each TrialSubmitted); the trials it shares a
prefix with and the first step at which it diverges from each (:func:`events.hp.first_divergence`);
the stages that trained its path (shared or not, with which trials, on which worker, for how
many seconds); its checkpoints; its metrics; and every tuner decision naming it, with the
evidence it was decided on (:mod:`events.decisions`), e.g. ``step 40: stopped by
SuccessiveHalving, rung 2: rank 9 of 16 by val_acc 0.9610, top 4 kept (threshold 0.9777)``.

Everything is read from the projection folded from the log (:mod:`projections.queries`), plus
the events the projection does not keep (request offsets, stage seconds). A trial id may be given
by a unique prefix. Units: steps, seconds (worker-held, from StageFinished), bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from events import topics
from events.decisions import decision_from_json
from events.hp import config_to_json
from events.models import TrialSubmitted
from projections import queries
from replay.audit import AuditError, Source, fold, open_source
from replay.report.load import stage_runs
from replay.tuner import plan_events
from stagetree.words import counted


@dataclass
class Story:
    """A trial's story; :meth:`as_dict` is ``--json``'s document, :meth:`lines` the text."""

    trial_id: str
    study_id: str
    tuner: str | None
    plan_key: str
    status: str
    error: str | None
    steps: int
    hp: dict[str, Any]
    hp_text: dict[str, str]
    requests: list[dict[str, Any]] = field(default_factory=list)
    shares_prefix_with: list[dict[str, Any]] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def lines(self) -> list[str]:
        """The story as text, one line per fact."""
        out = [f"trial {self.trial_id} of study {self.study_id}" + (f" ({self.tuner})" if self.tuner else "")
               + f", plan {self.plan_key}: {self.status}, {self.steps} steps"
               + (f" (error: {self.error})" if self.error else "")]
        out.append("configuration:")
        width = max((len(n) for n in self.hp_text), default=0)
        out += [f"  {name.ljust(width)}  {text}" for name, text in sorted(self.hp_text.items())]
        out.append("requests: " + ", ".join(
            f"{r['steps']} steps (offset {r['offset']}, {'answered' if r['answered'] else 'not answered'})"
            for r in self.requests))
        if self.shares_prefix_with:
            out.append(f"shares a prefix with {counted(len(self.shares_prefix_with), 'trial')} (the first step at "
                       "which the hyper-parameters differ):")
            out += [f"  {s['trial_id']}  step {s['diverges_at']}" + ("" if s["differs"] else " (no difference "
                                                                           "within both trials' steps)")
                    for s in self.shares_prefix_with]
        else:
            out.append("shares no prefix with another trial")
        shared = sum(1 for s in self.stages if len(s["trials"]) > 1)
        out.append(f"stages that trained it ({len(self.stages)}, {shared} shared):")
        for s in self.stages:
            others = [t for t in s["trials"] if t != self.trial_id]
            secs = f"{s['seconds']:.2f} s" if s["seconds"] is not None else s["status"]
            with_ = f"shared with {counted(len(others), 'trial')}: {', '.join(others)}"
            out.append(f"  {s['node_id']} [{s['from_step']}, {s['to_step']}) on {s['worker_id']} ({s['dispatch_id']}), "
                       f"{secs}, " + (with_ if others else "this trial only"))
        out.append("checkpoints: " + (", ".join(f"step {c['step']} ({c['node_id']}, sha256 {c['ref'][:12]}, "
                                                  f"{c['size']:,} bytes)" for c in self.checkpoints) or "none"))
        out.append("metrics:")
        out += [f"  step {m['step']}: " + ", ".join(f"{k} {_num(v)}" for k, v in sorted(m["metrics"].items()))
                for m in self.metrics] or ["  none"]
        out.append("decisions:")
        out += [f"  offset {d['offset']} (decided at {d['decided_at']}): {d['text']}"
                + (f" [as {d['role']}]" if d["role"] != "trial" else "") for d in self.decisions] or ["  none"]
        out += [f"note: {n}" for n in self.notes]
        return out


def _num(v: Any) -> str:
    return "none" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)


def explain(source: str | Path | Source, trial: str, *, secret: bytes | None = None) -> Story:
    """The story of the trial whose id is (or starts with) ``trial`` in ``source`` (a run
    directory, a JSONL export or kafka://...).

    Raises:
        AuditError: the source cannot be read, or ``trial`` names no trial or several.
    """
    opened = source if isinstance(source, Source) else open_source(str(source), secret=secret)
    state = fold(opened.streams.get(topics.PLAN, []), secret=secret)
    try:
        t = queries.find_trial(state, trial)
    except KeyError as exc:
        raise AuditError(str(exc.args[0])) from None
    events = plan_events(opened)
    submitted: dict[int, int] = {}
    for offset, e in events:
        if isinstance(e, TrialSubmitted) and e.trial_id == t.trial_id:
            submitted.setdefault(e.steps, offset)
    decided = queries.decisions_about(state, t.trial_id)
    tuner = next((d.tuner for d in decided if d.study_id == t.study_id), None)
    story = Story(t.trial_id, t.study_id, tuner, t.plan_key, t.status, t.error, t.steps,
                  config_to_json(t.hp), {name: str(fn) for name, fn in t.hp.items()})
    story.requests = [{"steps": s, "node_id": node, "offset": submitted.get(s), "answered": s in t.results,
                       "metrics": t.results.get(s)} for s, node in sorted(t.requests.items())]
    diverge = queries.divergences(state, t)
    story.shares_prefix_with = [
        {"trial_id": other, "diverges_at": step, "differs": step < min(t.steps, state.trials[other].steps)}
        for other, step in sorted(diverge.items(), key=lambda kv: (-kv[1], kv[0]))]
    path = queries.trial_path(state, t)
    story.stages = [{"node_id": r.node_id, "from_step": r.from_step, "to_step": r.to_step,
                     "dispatch_id": r.dispatch_id, "worker_id": r.worker_id, "status": r.status,
                     "seconds": r.seconds if r.status == "finished" else None,
                     "trials": (served := queries.trials_through(state, r.plan_key, r.node_id, r.to_step)),
                     "shared": len(served) > 1}
                    for r in stage_runs(events) if r.plan_key == t.plan_key
                    and queries.on_path(path, r.node_id, r.from_step, r.to_step)]
    story.checkpoints = [{"node_id": node, "step": step, "ref": c.ref, "size": c.size}
                         for node, step, c in queries.checkpoints_on_path(state, t)]
    story.metrics = [{"step": step, "node_id": node, "metrics": m}
                     for step, node, m in queries.metrics_on_path(state, t)]
    story.decisions = [{"offset": d.offset, "decided_at": d.decided_at, "study_id": d.study_id, "tuner": d.tuner,
                        "role": d.role, "kind": d.decision["kind"],
                        "text": decision_from_json(d.decision).describe(d.tuner), "decision": d.decision}
                       for d in decided]
    if not decided:
        has_any = any(state.decided.values())
        story.notes.append("no tuner decision names this trial" if has_any else
                           "the log holds no tuner decisions (its tuner recorded none, or the log was written "
                           "before decisions were events)")
    return story

"""MLtuner on the search plan: online tuning of training tunables by snapshot and branch.

MLtuner (Cui, Ganger and Gibbons, "MLtuner: System Support for Automatic Machine Learning
Tuning", SoCC'18, §3-4; restated in RELATED_SPEC.md §2, §3.2-3.4, adopted per §4.2) tunes the
*training tunables* of one training run while it trains: from a snapshot of the run it forks
short trial branches with different settings, keeps the branch whose loss falls fastest
(:func:`stagetree.summarizer.summarize`), continues from it, and re-tunes when the validation
metric stops improving.

In stagetree a branch needs no fork primitive: it is a trial whose hyper-parameter sequences
equal the main line's up to the snapshot step ``s`` and take the candidate setting from ``s`` on
(:func:`events.hp.continue_with`). The search plan therefore places every branch as a
child of the main line's node at ``s`` and starts it from the main line's checkpoint there, and
"continue from the best branch" costs nothing: the best branch's configuration *is* the main
line's next configuration, so the steps it trained are the main line's steps.

Units: every length and step count is in steps (optimizer updates of the trainer); a
convergence speed is progress-metric units per step.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

import numpy as np

from events.decisions import Answer, Continue, Draw, Keep, Patience, Progress, Promote, Ranking, Retune, Stop
from events.hp import Constant, HPConfig, HPFunction, Piecewise, as_hp, continue_with
from stagetree.spaces import candidates_of
from stagetree.study import Study, TrialFailed, wait_all
from stagetree.summarizer import CONVERGING, DIVERGED, Summary, summarize, top_within
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, positive_int, stable_seed

__all__ = ["MLtunerTuner"]


def _extend(fn: HPFunction, then: HPFunction, at: int) -> HPFunction:
    """``fn`` up to step ``at``, then ``then`` (in its own frame). At step 0 that is ``then``;
    a constant that equals the constant ``fn`` already ends with is ``fn`` itself, so keeping
    the current setting keeps the main line's trial."""
    if at == 0:
        return then
    last = fn.functions[-1] if isinstance(fn, Piecewise) else fn
    if isinstance(then, Constant) and isinstance(last, Constant) and then == last:
        return fn
    return continue_with(fn, then, at)


@dataclass
class _Branch:
    """One trial branch of a tuning round: its configuration, trial id, and latest summary."""

    config: HPConfig
    trial_id: str
    summary: Summary | None = None
    length: int = 0  # the trial length it was last summarised at

    @property
    def speed(self) -> float:
        return self.summary.speed if self.summary is not None else 0.0


@dataclass
class _Round:
    """The outcome of a tuning round: the chosen branch (None: keep the main line), its trial
    length, and how many branches the round tried."""

    chosen: _Branch | None
    length: int
    tried: int


class MLtunerTuner(Tuner):
    """MLtuner (SoCC'18 §3-4; RELATED_SPEC.md §3.3-3.4) as a stagetree tuner.

    The first configuration of ``space`` is the initial main line ``C`` at step ``s = 0``; the
    names in ``tunables`` are tuned, every other name keeps its sequence. The run:

    1. **Tuning round** at step ``s`` (round ``r``). The searcher proposes settings in a
       deterministic order: a permutation of the product of the tunables' candidates drawn
       with ``numpy.random.default_rng(stable_seed(study, "mltuner", r))``. A branch for a
       setting is ``C`` up to ``s``, then the setting (a search-plan child at ``s``). A branch
       run at trial length ``L`` requests ``progress_metric`` at ``points`` evenly spaced steps
       ``s + floor(i * L / points)`` (``i = 1..points``); that trace is summarised with ``k``
       windows (:func:`summarize`), and the branch's speed is loss drop per step.

       * Phase 1 (Algorithm 1): ``L = trial_steps``. Propose one setting; run every live
         branch to ``L`` (older branches are topped up: their earlier steps are reused by the
         plan); drop diverged branches; stop when one is converging. Otherwise double ``L``
         (lengths are ``trial_steps * 2**j``, §4.2 item 4) and propose the next setting, until
         candidates or ``max_branches`` run out and ``L`` reaches its cap. The best
         converging branch (highest speed, earliest proposed on ties) is the best so far.
       * Phase 2: at the fixed ``L``, keep proposing (up to ``max_branches`` in all); a
         branch faster than the best replaces it. Stop early when :func:`top_within`
         (``top_n`` non-zero speeds within ``tolerance`` of the best) holds. Settings are
         proposed in batches that cannot pass that stopping point (at most
         ``top_n - nonzero speeds`` at once while fewer than ``top_n`` are non-zero, then one
         at a time), so the scheduler runs branches in parallel and the branches tried are
         exactly those of a one-at-a-time search.

       The best branch becomes the main line: ``C`` = its configuration, ``s = s + L``, and
       its metrics at ``s`` are the main line's evaluation there. If phase 1 ends with no
       converging branch the round keeps the main line as it is (decision ``"keep"``).
    2. **Training.** The main line is evaluated every ``epoch_steps`` steps (``s +
       epoch_steps``, ... capped at ``max_steps``), tracking the best ``metric``. After
       ``patience - 1`` evaluations in a row without improvement it re-tunes at the current
       step (RELATED_SPEC §3.4) with ``L`` capped at ``epoch_steps`` and at most as many
       branches as the previous round tried; after ``patience`` it stops, as it does at
       ``max_steps``.

    The answer (``TunerResult.best``) is the main line's evaluation with the best ``metric``
    (the first on ties): the selection points of the rounds and the epoch evaluations; its
    ``trial_id``/``hp`` are the main-line configuration at that step and ``steps`` the step.
    ``TunerResult.trials`` holds every trial's latest result. Decisions (:mod:`events.decisions`),
    in order: a ``draw`` per branch (``branch_of`` the main line, its ``round``, its index in the
    round's permutation and the permutation's ``seed``); ``stop`` "diverged" for a branch that
    diverged, ``continue`` for the live branches when phase 1 doubles the trial length; at the
    end of a round ``promote`` for the chosen branch (it becomes the main line) and ``stop``
    "slower" for the others, or ``stop`` "not-converging" for the live branches and ``keep`` for
    the main line; each with the branch's :class:`~events.decisions.Progress`. On the main line:
    ``continue`` to each epoch evaluation, ``retune`` (starting a round), ``stop`` "patience",
    "max_steps" or "failed", each with its :class:`~events.decisions.Patience`; last, the
    ``answer``.

    Departures from the paper: time is logical (steps, not seconds), so a speed is per step
    and decisions are a function of the metrics alone (identical on any number of workers,
    RELATED_SPEC §2.4); the searcher is a seeded permutation of a grid, not HyperOpt; trial
    lengths are capped (``max_steps - s`` in the first round, ``min(epoch_steps, max_steps -
    s)`` in re-tunes), and a round whose phase 1 reaches the cap with nothing converging keeps
    the main line instead of doubling forever; validation is the main line's own evaluation
    at each epoch (no separate TESTING branch: a request's metrics include it).

    Assumptions: the tunables are *training tunables* (learning rate, momentum, ...) that
    leave the objective unchanged; only then are the losses of different branches comparable
    (SoCC'18 §3; RELATED_SPEC §4.2 item 6). Speeds per step favour settings that cost more per
    step (e.g. larger batches); compare such tunables with care. ``progress_metric`` must be
    lower-is-better; a null (NaN) value counts as divergence, a missing one raises KeyError.

    Args:
        space: configurations; the first is the initial main line.
        metric, mode: the validation metric tracked for re-tuning, stopping and the answer.
        tunables: name -> candidate values or sequences (numbers, HPFunction or JSON dicts).
        max_steps: the main line's training budget.
        epoch_steps: the main line's evaluation interval (MLtuner's epoch).
        trial_steps: the first trial length of a round.
        points: progress points per branch (>= 2).
        progress_metric: the summarizer's x (lower is better).
        k: summarizer windows; eps: its stability threshold (None: ``1 / k``).
        patience: P of §3.4 (>= 2).
        max_branches: branches per round (re-tunes: also at most the previous round's).
        top_n, tolerance: :func:`top_within`'s stopping rule.

    Raises:
        ValueError: any invalid argument (naming the field and the value), an empty space, or
            tunables the initial configuration lacks.
    """

    def __init__(self, space: Iterable[Mapping[str, Any]], metric: str = "val_acc", mode: Mode = "max", *,
                 tunables: Mapping[str, Sequence[Any]], max_steps: int, epoch_steps: int, trial_steps: int,
                 points: int = 10, progress_metric: str = "loss", k: int = 5, eps: float | None = None,
                 patience: int = 5, max_branches: int = 8, top_n: int = 5, tolerance: float = 0.10) -> None:
        super().__init__(space, metric, mode)  # type: ignore[arg-type]  # checks an empty space; set below
        self.max_steps = positive_int("max_steps", max_steps)
        self.epoch_steps = positive_int("epoch_steps", epoch_steps)
        self.trial_steps = positive_int("trial_steps", trial_steps)
        if epoch_steps > max_steps:
            raise ValueError(f"`epoch_steps` is {epoch_steps}, but must be <= max_steps {max_steps}")
        if trial_steps > max_steps:
            raise ValueError(f"`trial_steps` is {trial_steps}, but must be <= max_steps {max_steps}")
        self.points = positive_int("points", points, 2)
        if not isinstance(progress_metric, str) or not progress_metric:
            raise ValueError(f"`progress_metric` is {progress_metric!r}, but must name a metric")
        self.progress_metric = progress_metric
        self.k = positive_int("k", k)
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, Real) or not math.isfinite(eps)
                                or eps <= 0):
            raise ValueError(f"`eps` is {eps!r}, but must be a finite number > 0 (or None for 1/k)")
        self.eps = eps
        self.patience = positive_int("patience", patience, 2)
        self.max_branches = positive_int("max_branches", max_branches)
        self.top_n = positive_int("top_n", top_n)
        if isinstance(tolerance, bool) or not isinstance(tolerance, Real) or not (
                math.isfinite(tolerance) and tolerance >= 0):
            raise ValueError(f"`tolerance` is {tolerance!r}, but must be a finite number >= 0")
        self.tolerance: float = float(tolerance)
        if not isinstance(tunables, Mapping) or not tunables:
            raise ValueError(f"`tunables` is {tunables!r}, but must map at least one name to candidates")
        self.tunables: dict[str, list[HPFunction]] = candidates_of("tunables", tunables)
        first = next(iter(space), None)
        if first is None:
            raise ValueError(f"`space` is {space!r}, but must hold at least one configuration")
        if not isinstance(first, Mapping):
            raise ValueError(f"`space`'s first configuration is {first!r}, but must be a mapping")
        try:
            self.initial: HPConfig = {name: as_hp(v) for name, v in first.items()}
        except (TypeError, ValueError) as exc:
            raise ValueError(f"`space`'s first configuration: {exc}") from None
        self.space = [self.initial]
        missing = sorted(set(self.tunables) - set(self.initial))
        if missing:
            raise ValueError(f"`tunables` names {missing}, which the initial configuration "
                             f"{sorted(self.initial)} lacks")

    # ------------------------------------------------------------------ pieces

    def tunable_settings(self) -> list[dict[str, HPFunction]]:
        """Every setting of the tunables (their candidates' product, in the given order)."""
        names = list(self.tunables)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.tunables[n] for n in names))]

    def trace_steps(self, start: int, length: int) -> list[int]:
        """The steps a branch from ``start`` run for ``length`` steps reports progress at."""
        return sorted({start + (i * length) // self.points for i in range(1, self.points + 1)} - {start})

    def branch(self, config: HPConfig, setting: Mapping[str, HPFunction], at: int) -> HPConfig:
        """``config`` up to step ``at``, with the tunables of ``setting`` from ``at`` on."""
        out = dict(config)
        for name, fn in setting.items():
            out[name] = _extend(config[name], fn, at)
        return out

    # ------------------------------------------------------------------ the run

    def _patience(self, value: float | None, best: float | None, stale: int) -> Patience:
        return Patience(metric=self.metric, mode=self.mode, value=value, best=best, stale=stale,
                        patience=self.patience)

    async def run(self, study: Study) -> TunerResult:
        everything: dict[str, TrialResult] = {}
        main = study.config(self.initial)
        step = 0
        best: TrialResult | None = None
        best_score = -math.inf
        last: float | None = None  # the main line's latest value of `metric`
        evaluations = 0
        stale = 0  # main-line evaluations since the last improvement of `metric`
        previous = self.max_branches
        rnd = 0

        def evaluate(config: HPConfig, at: int, metrics: dict[str, float]) -> None:
            nonlocal best, best_score, stale, last, evaluations
            result = TrialResult(study.trial_id(config), config, at, metrics)
            self._record(everything, result)
            score = self.score(metrics)
            last, evaluations = self.value(result), evaluations + 1
            if best is None or score > best_score:
                best = result
            if score > best_score:
                best_score, stale = score, 0
            else:
                stale += 1

        def patience() -> Patience:
            return self._patience(last, self.value(best) if best is not None else None, stale)

        async def tune(cap_length: int, cap_branches: int) -> bool:
            """A round at the current step; True when it moved the main line (and evaluated it)."""
            nonlocal main, step, previous
            outcome = await self._round(study, rnd, main, step, cap_length, cap_branches, everything)
            previous = outcome.tried
            if outcome.chosen is None:
                return False
            main = outcome.chosen.config
            step += outcome.length
            evaluate(main, step, await study.submit(main, step))  # answered: the branch's last point
            return True

        await tune(self.max_steps, self.max_branches)
        while True:
            main_id = study.trial_id(main)
            if stale >= self.patience:
                self.decide(study, Stop(trial_id=main_id, step=step, reason="patience", evidence=patience()))
                break
            if step >= self.max_steps:
                self.decide(study, Stop(trial_id=main_id, step=step, reason="max_steps", evidence=patience()))
                break
            if stale == self.patience - 1:
                rnd += 1
                self.decide(study, Retune(trial_id=main_id, step=step, round=rnd, evidence=patience()))
                if await tune(min(self.epoch_steps, self.max_steps - step), min(self.max_branches, previous)):
                    continue  # the selection point was an evaluation: check patience again
            nxt = min(step + self.epoch_steps, self.max_steps)
            self.decide(study, Continue(trial_id=main_id, step=step, to_step=nxt, evidence=patience()))
            try:
                metrics = await study.submit(main, nxt)
            except TrialFailed as exc:  # the main line failed: a loss; the answer is the best so far
                self._record(everything, TrialResult(main_id, main, nxt, {}, error=exc.error or "failed"))
                self.decide(study, Stop(trial_id=main_id, step=nxt, reason="failed"))
                break
            step = nxt
            evaluate(main, step, metrics)
        if best is not None:
            self.decide(study, Answer(trial_id=best.trial_id, step=best.steps, evidence=Ranking(
                metric=self.metric, mode=self.mode, value=self.value(best), rank=1, of=evaluations, kept=1,
                threshold=self.value(best))))
        return TunerResult(best, self.metric, self.mode, sorted(everything.values(), key=lambda r: r.trial_id),
                           list(study.decisions))

    @staticmethod
    def _record(everything: dict[str, TrialResult], result: TrialResult) -> None:
        old = everything.get(result.trial_id)
        if old is None or result.steps >= old.steps:
            everything[result.trial_id] = result

    async def _run_branch(self, study: Study, branch: _Branch, start: int, length: int,
                          everything: dict[str, TrialResult]) -> Summary:
        """Request ``branch``'s progress points up to ``start + length`` and summarise them."""
        steps = self.trace_steps(start, length)
        try:
            metrics = await wait_all([study.submit(branch.config, s) for s in steps])
        except TrialFailed as exc:  # a failed trial is a loss: dropped like a diverged branch
            self._record(everything, TrialResult(branch.trial_id, branch.config, steps[-1], {},
                                                 error=exc.error or "failed"))
            return Summary(DIVERGED, 0.0, 0.0, 0.0, 0.0, 0)
        trace = []
        for s, m in zip(steps, metrics):
            if self.progress_metric not in m:
                raise KeyError(f"progress metric {self.progress_metric!r} not reported; reported: {sorted(m)}")
            value = m[self.progress_metric]
            trace.append((s, math.nan if value is None else float(value)))
        self._record(everything, TrialResult(branch.trial_id, branch.config, steps[-1], metrics[-1]))
        return summarize(trace, self.k, self.eps)

    async def _run_all(self, study: Study, rnd: int, branches: list[_Branch], start: int, length: int,
                       everything: dict[str, TrialResult], stopped: set[str]) -> None:
        """Run ``branches`` to ``length`` at once, keep their summaries and stop (in order) the
        ones that diverged."""
        summaries = await asyncio.gather(*(self._run_branch(study, b, start, length, everything)
                                           for b in branches))
        for b, summary in zip(branches, summaries):
            b.summary, b.length = summary, length
            if summary.label == DIVERGED and b.trial_id not in stopped:
                stopped.add(b.trial_id)
                self.decide(study, Stop(trial_id=b.trial_id, step=start + length, reason="diverged",
                                        evidence=self._progress(rnd, b)))

    def _progress(self, rnd: int, b: _Branch) -> Progress:
        assert b.summary is not None
        return Progress(metric=self.progress_metric, round=rnd, length=b.length, label=b.summary.label,
                        speed=b.summary.speed)

    async def _round(self, study: Study, rnd: int, main: HPConfig, start: int, cap_length: int,
                     cap_branches: int, everything: dict[str, TrialResult]) -> _Round:
        """One tuning round from ``main`` at step ``start`` (RELATED_SPEC §3.3)."""
        settings = self.tunable_settings()
        seed = stable_seed(study.name, "mltuner", str(rnd))
        rng = np.random.default_rng(seed)
        order = [settings[int(i)] for i in rng.permutation(len(settings))]
        main_id = study.trial_id(main)
        tried: list[_Branch] = []
        stopped: set[str] = set()

        def can_propose() -> bool:
            return len(tried) < min(cap_branches, len(order))

        def propose() -> _Branch | None:
            if not can_propose():
                return None
            config = study.config(self.branch(main, order[len(tried)], start))
            b = _Branch(config, study.trial_id(config))
            self.decide(study, Draw(trial_id=b.trial_id, step=start, to_step=start + length, sampler=self.name,
                                    index=len(tried), seed=seed, branch_of=main_id, round=rnd))
            tried.append(b)
            return b

        # Phase 1: find a trial length at which something converges.
        length = min(self.trial_steps, cap_length)
        live: list[_Branch] = []
        best: _Branch | None = None
        ran_at = 0
        while True:
            new = propose()
            if new is None and (not live or ran_at == length):
                break
            if new is not None:
                live.append(new)
            await self._run_all(study, rnd, live, start, length, everything, stopped)
            ran_at = length
            live = [b for b in live if b.summary is not None and b.summary.label != DIVERGED]
            converging = [b for b in live if b.summary is not None and b.summary.label == CONVERGING]
            if converging:
                best = max(converging, key=lambda b: b.speed)  # max keeps the first of equals
                break
            if length < cap_length and (live or can_propose()):
                longer = min(2 * length, cap_length)
                for b in live:  # nothing converges yet: the live branches run on at the doubled length
                    self.decide(study, Continue(trial_id=b.trial_id, step=start + length, to_step=start + longer,
                                                evidence=self._progress(rnd, b)))
                length = longer
        if best is None:
            for b in live:
                if b.trial_id not in stopped:
                    stopped.add(b.trial_id)
                    self.decide(study, Stop(trial_id=b.trial_id, step=start + b.length, reason="not-converging",
                                            evidence=self._progress(rnd, b)))
            self.decide(study, Keep(trial_id=main_id, step=start, round=rnd, reason="no converging branch"))
            return _Round(None, length, len(tried))

        # Phase 2: fixed length; stop on the budget, the candidates, or top_within.
        def speeds() -> list[float]:
            return [b.speed for b in tried]

        while not top_within(speeds(), self.top_n, self.tolerance):
            nonzero = sum(1 for s in speeds() if s > 0)
            size = max(1, self.top_n - nonzero)
            batch = [b for b in (propose() for _ in range(size)) if b is not None]
            if not batch:
                break
            await self._run_all(study, rnd, batch, start, length, everything, stopped)
            for b in batch:
                if b.speed > best.speed:
                    best = b
        self.decide(study, Promote(trial_id=best.trial_id, step=start + length, to_step=start + length,
                                   evidence=self._progress(rnd, best)))
        stopped.add(best.trial_id)
        for b in tried:
            if b.trial_id not in stopped:
                stopped.add(b.trial_id)
                self.decide(study, Stop(trial_id=b.trial_id, step=start + b.length, reason="slower",
                                        evidence=self._progress(rnd, b)))
        return _Round(best, length, len(tried))

"""Hyperband (Li et al., JMLR 2018): brackets of successive halving run at once."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable

from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import (
    Mode,
    TrialResult,
    Tuner,
    TunerResult,
    check_range,
    check_reduction,
    stable_seed,
)


class Hyperband(Tuner):
    """Hyperband (Li et al., "Hyperband: A Novel Bandit-Based Approach to Hyperparameter
    Optimization", JMLR 2018, Algorithm 1): brackets of successive halving that trade the number
    of configurations against the steps each starts with.

    With ``s_max = floor(log_reduction(max_steps / min_steps))``, bracket ``s`` (``s_max`` down
    to 0) starts ``n_s = ceil((s_max + 1) / (s + 1) * reduction**s)`` configurations at
    ``max_steps / reduction**s`` steps (rounded, at least ``min_steps``) and keeps the best
    ``floor(n / reduction)`` (at least one) at each rung, up to ``max_steps``. Brackets run at
    once. Configurations are dealt to brackets in the order of a stable hash of
    ``(study, trial id)``, cycling through the space when it is smaller than the brackets need
    (a configuration in two brackets is one trial, trained once). The answer is the best final
    result over all brackets. Units: steps. Decisions: the ``draw`` of each bracket's
    configurations (bracket by bracket, before any trains), the ``promote``/``stop`` of each
    rung (naming the bracket), and the ``answer``.

    Raises:
        ValueError: non-positive steps, ``min_steps > max_steps`` or ``reduction < 2``.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, min_steps: int,
                 max_steps: int, reduction: int = 3) -> None:
        super().__init__(space, metric, mode)
        self.min_steps, self.max_steps = check_range(min_steps, max_steps)
        self.reduction = check_reduction(reduction)

    def brackets(self) -> list[tuple[int, list[int]]]:
        """``(n configurations, rung steps)`` of each bracket, most exploratory first."""
        s_max = 0
        while self.min_steps * self.reduction ** (s_max + 1) <= self.max_steps:
            s_max += 1
        out = []
        for s in range(s_max, -1, -1):
            n = math.ceil((s_max + 1) * self.reduction**s / (s + 1))
            budgets = [max(self.min_steps, round(self.max_steps / self.reduction ** (s - i))) for i in range(s + 1)]
            out.append((n, budgets))
        return out

    async def run(self, study: Study) -> TunerResult:
        space = self.configurations(study)
        order = sorted(range(len(space)), key=lambda i: stable_seed(study.name, study.trial_id(study.config(space[i]))))
        jobs = []
        position = 0
        for b, (n, budgets) in enumerate(self.brackets()):
            chosen: dict[str, int] = {}  # trial id -> index in the space
            for j in range(n):
                if not order:
                    break
                i = order[(position + j) % len(order)]
                chosen.setdefault(study.trial_id(study.config(space[i])), i)
            position += n
            indexes = list(chosen.values())
            configs = self.draw(study, [space[i] for i in indexes], budgets[0], indexes=indexes, bracket=b)
            jobs.append(self._bracket(study, b, configs, budgets))
        outcomes = await asyncio.gather(*jobs)
        everything: dict[str, TrialResult] = {}
        final: dict[str, TrialResult] = {}
        for last, seen in outcomes:
            everything.update(seen)
            final.update({r.trial_id: r for r in last})
        return self._result(study, list(final.values()), everything)

    async def _bracket(self, study: Study, bracket: int, alive: list[HPConfig], budgets: list[int]
                       ) -> tuple[list[TrialResult], dict[str, TrialResult]]:
        seen: dict[str, TrialResult] = {}
        results: list[TrialResult] = []
        for k, steps in enumerate(budgets):
            if not alive:
                break
            results = await self._train(study, alive, steps)
            seen.update({r.trial_id: r for r in results})
            if k + 1 < len(budgets):
                kept = self.cut(study, results, max(1, len(alive) // self.reduction), k, budgets[k + 1],
                                bracket=bracket)
                alive = [r.hp for r in kept]
        return results, seen

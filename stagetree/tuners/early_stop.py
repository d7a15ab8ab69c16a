"""Early stopping at milestones: Hippo's ``EarlyStopTuner`` (Fig. 9, §5.5)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from events.hp import HPConfig
from stagetree.study import Study
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, positive_int


@dataclass(frozen=True)
class Schedule:
    """Early-stopping milestones: at ``steps``, keep the best ``keep`` trials alive (Hippo §5.5).

    ``Schedule.from_milestones((5, 8), (10, 4))`` trains 8 trials to 5 steps, keeps the best 4
    and trains them to 10.
    """

    milestones: tuple[tuple[int, int], ...]

    @classmethod
    def from_milestones(cls, *milestones: tuple[int, int]) -> Schedule:
        """Raises ValueError unless steps strictly increase and kept counts do not increase."""
        if not milestones:
            raise ValueError("`milestones` is empty, but must hold (steps, keep) pairs")
        for i, pair in enumerate(milestones):
            if len(pair) != 2:
                raise ValueError(f"`milestones[{i}]` is {pair!r}, but must be a (steps, keep) pair")
            positive_int(f"milestones[{i}].steps", pair[0])
            positive_int(f"milestones[{i}].keep", pair[1])
            if i and (pair[0] <= milestones[i - 1][0] or pair[1] > milestones[i - 1][1]):
                raise ValueError(f"`milestones[{i}]` is {pair!r}: steps must increase and keep must not")
        return cls(tuple((int(s), int(k)) for s, k in milestones))


class EarlyStopTuner(Tuner):
    """Train the space through a :class:`Schedule`, stopping the worst trials at each milestone
    (Hippo's ``EarlyStopTuner``, Fig. 9). The first milestone's ``keep`` caps how many
    configurations start (in space order)."""

    def __init__(self, schedule: Schedule, space: Iterable[HPConfig], metric: str, mode: Mode = "max") -> None:
        super().__init__(space, metric, mode)
        self.schedule = schedule

    async def run(self, study: Study) -> TunerResult:
        milestones = self.schedule.milestones
        alive = self.draw(study, self.configurations(study, milestones[0][1]), milestones[0][0])
        everything: dict[str, TrialResult] = {}
        results: list[TrialResult] = []
        for i, (steps, _) in enumerate(milestones):
            results = await self._train(study, alive, steps)
            everything.update({r.trial_id: r for r in results})
            if i + 1 < len(milestones):
                next_steps, keep = milestones[i + 1]
                alive = [r.hp for r in self.cut(study, results, keep, i, next_steps)]
        return self._result(study, results, everything)

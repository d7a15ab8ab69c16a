"""Population based training (Jaderberg et al. 2017) on the search plan."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from events.decisions import Continue, Exploit, Quantiles, Stop
from events.hp import HPConfig, continue_with
from gpu_worker.trainer import Trainer
from stagetree.spaces import candidates_of
from stagetree.study import Study
from stagetree.tuners._base import Mode, TrialResult, Tuner, TunerResult, check_causal, positive_int, stable_seed
from stagetree.tuners._inbox import ResultInbox


class PBT(Tuner):
    """Population based training (Jaderberg et al., "Population Based Training of Neural
    Networks", 2017, §3), on the search plan.

    The first ``population`` configurations of the space train in ``interval``-step
    generations up to ``max_steps``. Truncation selection (§4.1): a member whose result at step
    ``g`` is in the bottom ``quantile`` of the population's results at ``g`` (while the top
    ``quantile`` holds at least one other trial) *exploits*: it takes the configuration of a
    trial drawn from the top ``quantile`` (the donor) and *explores* from step ``g`` on: every
    hyper-parameter named in ``mutations`` is resampled from its candidates with probability
    ``resample_probability``, else moved to a neighbouring candidate (by the value at ``g``).
    The new member is a new trial whose sequences equal the donor's up to ``g``
    (:func:`continue_with`), so the search plan branches a new node at the donor's step ``g``
    and the member starts from the donor's checkpoint there: exploiting copies no weights, and
    a PBT schedule is an ordinary hyper-parameter sequence that report and replay show.

    Two members that exploit into the same configuration (the same donor, the same explored
    values) become one trial, trained once, that stays two members: each gets its own decisions
    at every later generation and it counts twice in the quantiles and the answer's ranking, as
    two identical members of the paper's population would (they would train alike).

    ``synch=True`` (the default, as Ray Tune's ``synch=True``): the members of a generation are
    decided together, once every member's result at ``g`` is in (a failed or cancelled member
    drops out), each ranked against all of them; the members that finish a generation first
    wait for the last. ``synch=False``: each member is decided as its result is handed over,
    ranked against the results at ``g`` handed over before it and itself, so no worker waits,
    but the members that report first in a generation are ranked among few and rarely exploit
    (with ``quantile=0.25``, none of the first three); logs recorded before 2026-11-28 were
    decided this way (verify them with ``synch=False`` in the study file).

    Random choices come from :func:`stable_seed` of ``(study, trial id, step)``. Units: steps.
    With ``causal=True`` each generation is a causal group. Assumes results at equal steps
    compare across members. Decisions: a ``draw`` per member, then per result below
    ``max_steps`` an ``exploit`` (naming the donor, the new member, the seed and the explored
    values) or a ``continue``, each with the member's :class:`~events.decisions.Quantiles`
    (a failed member: ``stop``, reason "failed"), and the ``answer``.

    Raises:
        ValueError: bad counts, a quantile outside (0, 0.5], a probability outside [0, 1], or a
            mutation that names no candidates; from :meth:`check`, a mutation of a hyper-parameter
            the trainer lacks.
    """

    def __init__(self, space: Iterable[HPConfig], metric: str, mode: Mode = "max", *, population: int,
                 interval: int, max_steps: int, mutations: Mapping[str, Sequence[Any]], quantile: float = 0.25,
                 resample_probability: float = 0.25, causal: bool = False, synch: bool = True) -> None:
        super().__init__(space, metric, mode)
        self.population = positive_int("population", population)
        self.interval = positive_int("interval", interval)
        self.max_steps = positive_int("max_steps", max_steps)
        if not isinstance(quantile, (int, float)) or not 0 < quantile <= 0.5:
            raise ValueError(f"`quantile` is {quantile!r}, but must be in (0, 0.5]")
        if not isinstance(resample_probability, (int, float)) or not 0 <= resample_probability <= 1:
            raise ValueError(f"`resample_probability` is {resample_probability!r}, but must be in [0, 1]")
        if not mutations:
            raise ValueError("`mutations` is empty, but must name at least one hyper-parameter to explore")
        self.mutations = candidates_of("mutations", mutations)
        self.quantile = float(quantile)
        self.resample_probability = float(resample_probability)
        self.causal = check_causal(causal)
        if not isinstance(synch, bool):
            raise ValueError(f"`synch` is {synch!r}, but must be True or False")
        self.synch = synch

    def generations(self) -> list[int]:
        """The steps at which members are compared: every ``interval`` steps, and ``max_steps``."""
        return [*range(self.interval, self.max_steps, self.interval), self.max_steps]

    def explore(self, config: HPConfig, at: int, rng: np.random.Generator) -> HPConfig:
        """``config`` up to step ``at``, with the mutated hyper-parameters changed from ``at`` on."""
        out = dict(config)
        for name in sorted(self.mutations):
            if name not in config:
                raise ValueError(f"`mutations` names {name!r}, which the configuration {sorted(config)} lacks")
            candidates = self.mutations[name]
            current = config[name].value(at)
            index = next((i for i, c in enumerate(candidates) if c.value(0) == current), None)
            if index is None or rng.random() < self.resample_probability:
                choice = candidates[int(rng.integers(len(candidates)))]
            else:
                step = 1 if rng.random() < 0.5 else -1
                choice = candidates[min(max(index + step, 0), len(candidates) - 1)]
            out[name] = continue_with(config[name], choice, at)
        return out

    def check(self, trainer: Trainer) -> None:
        """Every name in ``mutations`` is one of the trainer's hyper-parameters.

        Raises:
            ValueError: ``mutations`` names another.
        """
        for name in sorted(self.mutations):
            if name not in trainer.hyperparameters:
                raise ValueError(f"`mutations` names {name!r}, which trainer {trainer.name!r} lacks (its "
                                 f"hyper-parameters: {sorted(trainer.hyperparameters)})")

    async def run(self, study: Study) -> TunerResult:
        self.check(study.trainer)
        gens = self.generations()
        inbox: ResultInbox[int] = ResultInbox(study, self.causal)  # group and payload: the generation
        for config in self.draw(study, self.configurations(study, self.population), gens[0]):
            inbox.submit(config, gens[0], 0, 0)
        at_gen: list[list[TrialResult]] = [[] for _ in gens]
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        while inbox:
            g, result = await inbox.next()  # None: a cancelled request, which drops out
            if result is not None:
                everything[result.trial_id] = result
                if result.failed:  # the member ends; quantiles use results that exist
                    self.decide(study, Stop(trial_id=result.trial_id, step=gens[g], reason="failed"))
                else:
                    at_gen[g].append(result)
                    if g + 1 == len(gens):
                        final.append(result)
                    elif not self.synch:
                        self._select(study, inbox, gens, g, result, self.rank(at_gen[g]))
            if self.synch and g + 1 < len(gens) and not inbox.waiting(g):  # the whole generation is in
                ranked = self.rank(at_gen[g])
                for member in at_gen[g]:  # in the order handed over
                    self._select(study, inbox, gens, g, member, ranked)
        return self._result(study, final, everything)

    def _select(self, study: Study, inbox: ResultInbox[int], gens: list[int], g: int, result: TrialResult,
                ranked: list[TrialResult]) -> None:
        """Truncation selection of the member of ``result`` at generation ``g`` among ``ranked``
        (:meth:`rank` order): an ``exploit`` or a ``continue`` decision, and its request for the
        next generation."""
        cut = int(len(ranked) * self.quantile)
        top, bottom = ranked[:cut], ranked[len(ranked) - cut:] if cut else []
        place = next(i for i, r in enumerate(ranked) if r.trial_id == result.trial_id)
        evidence = Quantiles(metric=self.metric, mode=self.mode, value=self.value(result), rank=place + 1,
                             of=len(ranked), cut=cut, quantile=self.quantile)
        nxt = result.hp
        if cut and any(b.trial_id == result.trial_id for b in bottom) \
                and all(t.trial_id != result.trial_id for t in top):
            seed = stable_seed(study.name, result.trial_id, str(gens[g]))
            rng = np.random.default_rng(seed)
            donor = top[int(rng.integers(len(top)))]
            nxt = self.explore(donor.hp, gens[g], rng)
            explored = {name: nxt[name].value(gens[g]) for name in sorted(self.mutations)}
            self.decide(study, Exploit(trial_id=result.trial_id, step=gens[g], donor=donor.trial_id,
                                       new_trial_id=study.trial_id(study.config(nxt)), to_step=gens[g + 1],
                                       seed=seed, evidence=evidence, donor_value=self.value(donor),
                                       explored=explored))
        else:
            self.decide(study, Continue(trial_id=result.trial_id, step=gens[g], to_step=gens[g + 1],
                                        evidence=evidence))
        inbox.submit(nxt, gens[g + 1], g + 1, g + 1)

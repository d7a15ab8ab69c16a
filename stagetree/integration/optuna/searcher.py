"""Optuna's samplers propose, stagetree merges (issue 13 item 2).

Two ways to let any ``BaseSampler`` (TPE, CMA-ES, GP, QMC, random, ...) choose
configurations through Optuna's ask-and-tell interface, over the same space language as
:class:`~stagetree.spaces.RandomSearchSpace` (fixed values, candidate lists, :class:`Choice`,
:class:`Uniform`, :class:`LogUniform`, :class:`IntUniform`, :class:`Milestones` and
:class:`Sampled` sequences, whose parameters, initial value, milestones, gamma, warm-up length,
period, are Optuna parameters named ``<hp>.<parameter>``: :func:`stagetree.spaces.ask_config`):

* :class:`OptunaSearch`, a tuner on its own: ``n_trials`` configurations asked ``batch`` at a
  time, each trained to ``steps`` (optionally reported every ``report_every`` steps to an Optuna
  pruner, which may stop it), and told its result before the next batch is asked.
* :class:`OptunaSpace`, the configuration source of SuccessiveHalving, ASHA, Hyperband (or any
  tuner over a space), after BOHB (Falkner et al., ICML 2018): the tuner asks it for its
  configurations, and every decision the tuner takes is reported to the Optuna study, so
  Optuna's samplers and pruners, and ``optuna-dashboard``, see the intermediate value of each
  rung (``trial.report(value, step)`` on a promotion or a stop), stopped trials end pruned,
  failed ones failed, and the final rung's complete with their value.

The configurations are stagetree trials like any others: proposals that share a prefix (the same
warm-up, the same decay up to a milestone) are merged in the search plan and trained once. Every
configuration asked is a ``draw`` decision in the log (:mod:`events.decisions`) naming the
sampler and its seed; the Optuna study lives in any Optuna storage (``storage=``: a URL or an
``BaseStorage``; default in memory), named after the stagetree study unless
``study_name`` is given.

Determinism: a sampler given a seed (``TPESampler(seed=3)``; pass the same ``seed=`` so the
draws record it) proposes the same configurations for the same sequence of results told, and
both classes tell in an order fixed by the tuner's decisions (never by timing): the same
configurations and the same answer on any number of workers. ``replay verify`` recomputes the
draws with a fresh Optuna study in memory (a replay writes nothing outside the log); that equals
the live run when its Optuna study had no trials before it started (a new study name).

Needs ``pip install 'stagetree[optuna]'``.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import orjson

from events.decisions import Continue, Decision, Pruned, Stop
from events.hp import HPConfig
from stagetree.integration import require
from stagetree.spaces import ask_config, space_specs
from stagetree.study import Study
from stagetree.tuners import Mode, TrialResult, Tuner, TunerResult
from stagetree.tuners._base import positive_int
from stagetree.tuners._settings import jsonable

require("optuna", "optuna", "stagetree.integration.optuna")
from optuna import Study as OptunaStudy  # noqa: E402
from optuna import create_study  # noqa: E402
from optuna.pruners import BasePruner, NopPruner  # noqa: E402
from optuna.samplers import BaseSampler, TPESampler  # noqa: E402
from optuna.storages import BaseStorage, InMemoryStorage, get_storage  # noqa: E402
from optuna.trial import Trial as OptunaTrial  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

__all__ = ["OptunaSearch", "OptunaSpace"]

MAX_ASKS = 10
"""How many asks per configuration wanted before a space is taken as exhausted (a categorical
space smaller than ``n``): a sampler proposing a configuration already asked is told it failed
(user attribute ``duplicate_of``) and asked again."""


def component_settings(component: Any) -> dict[str, Any]:
    """An Optuna sampler's or pruner's settings as JSON data: its class and every attribute
    (:func:`~stagetree.tuners._settings.jsonable`; Optuna keeps its constructor's arguments as
    ``_name`` attributes, named here without the underscore), a sampler or pruner inside it in
    the same way, and its random state as a sha256 (``seed_state_sha256``: Optuna 5's samplers keep no
    seed, only a generator made from it; a sampler given no seed has a new one in every
    process). Read it before the component is used: its random state moves on."""
    out: dict[str, Any] = {"class": type(component).__qualname__}
    for key, value in sorted(vars(component).items()):
        name = key.lstrip("_")
        if isinstance(value, (BaseSampler, BasePruner)):
            out[name] = component_settings(value)
        elif key == "_rng":
            rng = getattr(value, "rng", value)  # Optuna's LazyRandomState, or a numpy RandomState
            state = rng.get_state() if callable(getattr(rng, "get_state", None)) else None
            out["seed_state_sha256"] = None if state is None else hashlib.sha256(
                orjson.dumps(jsonable(state))).hexdigest()  # (jsonable: the key array as a list)
        else:
            out[name] = jsonable(value)
    return out


def _direction(tuner: Tuner) -> Literal["maximize", "minimize"]:
    """The Optuna study's direction for ``tuner``'s mode."""
    return "maximize" if tuner.mode == "max" else "minimize"


def check_storage(storage: Any) -> None:
    """Check an Optuna ``storage`` argument without opening it (a study file is imported by
    every worker too): None, a ``BaseStorage``, or a database URL SQLAlchemy can parse, whose
    SQLite file, if any, is in a directory that exists.

    Raises:
        ValueError: anything else, naming ``storage`` and the value.
    """
    if storage is None or isinstance(storage, BaseStorage):
        return
    if not isinstance(storage, str):
        raise ValueError(f"`storage` is {storage!r}, but must be a database URL, an Optuna BaseStorage or None")
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage)
    except (ArgumentError, ValueError) as exc:
        raise ValueError(f"`storage` is {storage!r}, but is not a database URL ({exc})") from None
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        folder = Path(url.database).parent
        if not folder.is_dir():
            raise ValueError(f"`storage` is {storage!r}, but its SQLite file's directory {str(folder)!r} does "
                             "not exist")


class OptunaSpace:
    """Configurations proposed by an Optuna sampler, for a tuner over a space (BOHB-style); see
    the module docstring.

    Args:
        hp_dict: name -> a fixed value, a list of candidates or a sampler
            (:func:`stagetree.spaces.space_specs`).
        n: how many configurations the tuner gets (positive int).
        sampler: any ``BaseSampler``; default ``TPESampler(seed=seed)``.
        seed: the sampler's seed, recorded in every draw decision.
        storage: where the Optuna study lives (URL or ``BaseStorage``); None: in memory.
        study_name: the Optuna study's name; default the stagetree study's.
        pruner: the Optuna study's pruner (consulted by :class:`OptunaSearch`); default none.

    Raises:
        ValueError: an invalid ``hp_dict`` (naming the hyper-parameter and field), ``n``,
            ``seed``, ``sampler`` or ``pruner``; a ``storage`` that is neither None, a
            ``BaseStorage`` nor a database URL (:func:`check_storage`).
    """

    def __init__(self, hp_dict: Mapping[str, Any], n: int, *, sampler: BaseSampler | None = None,
                 seed: int | None = None, storage: str | BaseStorage | None = None,
                 study_name: str | None = None, pruner: BasePruner | None = None) -> None:
        self.specs = space_specs(hp_dict)
        self.n = positive_int("n", n)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
            raise ValueError(f"`seed` is {seed!r}, but must be an int in [0, 2**63) or None")
        if sampler is not None and not isinstance(sampler, BaseSampler):
            raise ValueError(f"`sampler` is {sampler!r}, but must be an BaseSampler")
        if pruner is not None and not isinstance(pruner, BasePruner):
            raise ValueError(f"`pruner` is {pruner!r}, but must be an BasePruner")
        check_storage(storage)
        self.sampler = sampler if sampler is not None else TPESampler(seed=seed)
        self.seed = seed if seed is not None else getattr(self.sampler, "_seed", None)
        self.sampler_name = type(self.sampler).__name__
        self.storage = storage
        self.study_name = study_name
        self.pruner = pruner if pruner is not None else NopPruner()
        # read now, before the sampler draws (its random state moves on with every draw)
        self._components = {"sampler": component_settings(self.sampler), "pruner": component_settings(self.pruner)}
        self._optuna: OptunaStudy | None = None
        self._for: Study | None = None
        self._tuner: Tuner | None = None
        self._configs: list[HPConfig] = []
        self._trials: dict[str, list[OptunaTrial]] = {}  # stagetree trial id -> its Optuna trials
        self._reported: set[tuple[int, int]] = set()  # (Optuna trial number, step)
        self._told: set[int] = set()
        # stagetree trial id -> how many of the tuner's brackets still hold it (Hyperband deals
        # a configuration to several brackets when the space is smaller than they need)
        self._held: dict[str, int] = {}

    def __iter__(self) -> Any:
        """No configuration exists before a study asks: a tuner calls :meth:`configurations`."""
        return iter(())

    def settings(self) -> dict[str, Any]:
        """The space as JSON data, recorded with its tuner's settings (:meth:`Tuner.settings`):
        its hyper-parameters' samplers, ``n``, the Optuna sampler's class and ``seed``, the
        pruner's class, the Optuna study's name (not the storage: where that study is kept), and
        the sampler's and pruner's own settings as they were built (``sampler_settings``,
        ``pruner_settings``: :func:`component_settings`, so a sampler's seed or
        ``n_startup_trials`` changed is a change)."""
        return {"space": type(self).__name__, "hp_dict": jsonable(self.specs), "n": self.n,
                "sampler": self.sampler_name, "seed": self.seed, "pruner": type(self.pruner).__name__,
                "study_name": self.study_name, "sampler_settings": self._components["sampler"],
                "pruner_settings": self._components["pruner"]}

    def __repr__(self) -> str:
        return f"OptunaSpace({self.specs!r}, n={self.n}, sampler={self.sampler_name}, seed={self.seed})"

    # ------------------------------------------------------------------ the Optuna study

    def optuna_study(self, study: Study, tuner: Tuner) -> OptunaStudy:
        """The Optuna study of ``study`` (created at the first call: maximising when the tuner
        maximises). In a storage of its own, in memory, in a replay of the log, and when the
        study writes no tuner state (:attr:`Study.writes_tuner_state`: a simulation, a resumed
        run) unless ``storage`` is itself an ``InMemoryStorage`` (one the caller made in this
        process, to read the Optuna study back)."""
        if self._optuna is None or self._for is not study:
            apart = study.replaying or not (study.writes_tuner_state or isinstance(self.storage, InMemoryStorage))
            storage = InMemoryStorage() if apart else self.storage
            self._optuna = create_study(
                storage=storage, sampler=self.sampler, pruner=self.pruner, study_name=self.study_name or study.name,
                direction=_direction(tuner), load_if_exists=True)
            self._for, self._tuner, self._configs = study, tuner, []
            self._trials.clear()
            self._held.clear()
        return self._optuna

    def ask(self, study: Study, tuner: Tuner, count: int) -> list[HPConfig]:
        """``count`` new configurations asked of the sampler, distinct from every one asked
        before in this study (fewer when the space runs out, see :data:`MAX_ASKS`).

        Raises:
            ValueError: a proposal is not a valid configuration for the study's trainer.
        """
        optuna_study = self.optuna_study(study, tuner)
        out: list[HPConfig] = []
        for _ in range(MAX_ASKS * count):
            if len(out) == count:
                break
            trial = optuna_study.ask()
            config = study.config(ask_config(self.specs, trial))
            trial_id = study.trial_id(config)
            if trial_id in self._trials:
                trial.set_user_attr("duplicate_of", trial_id)
                optuna_study.tell(trial, state=TrialState.FAIL)
                continue
            trial.set_user_attr("stagetree_trial", trial_id)
            self._trials[trial_id] = [trial]
            self._configs.append(config)
            out.append(config)
        return out

    def configurations(self, study: Study, tuner: Tuner, count: int | None = None) -> list[HPConfig]:
        """The tuner's configurations: the first ``count`` (default ``n``) asked for ``study``,
        asked on the first call (asking again returns the same)."""
        wanted = self.n if count is None else min(count, self.n)
        self.optuna_study(study, tuner)
        if len(self._configs) < wanted:
            self.ask(study, tuner, wanted - len(self._configs))
        return list(self._configs[:wanted])

    # ------------------------------------------------------------------ telling

    def report(self, trial_id: str, value: float | None, step: int) -> None:
        """Report ``value`` at ``step`` to the trial's Optuna trials (once per step)."""
        for trial in self._trials.get(trial_id, []):
            if value is not None and trial.number not in self._told and (trial.number, step) not in self._reported:
                self._reported.add((trial.number, step))
                trial.report(value, step)

    def should_prune(self, trial_id: str) -> bool:
        """The pruner's verdict on the trial's reports so far."""
        return any(t.should_prune() for t in self._trials.get(trial_id, []) if t.number not in self._told)

    def tell(self, trial_id: str, value: float | None, state: TrialState = TrialState.COMPLETE) -> None:
        """End the trial's Optuna trials: complete with ``value`` (failed without one), pruned
        or failed."""
        assert self._optuna is not None
        for trial in self._trials.get(trial_id, []):
            if trial.number in self._told:
                continue
            self._told.add(trial.number)
            if state == TrialState.COMPLETE and value is None:
                state = TrialState.FAIL
            self._optuna.tell(trial, value if state == TrialState.COMPLETE else None, state=state)

    def decided(self, study: Study, decision: Decision) -> None:
        """A tuner decision about one of the trials: its value at the decision's step is reported
        (the rung, the evaluation), and a stop ends the Optuna trial, pruned (failed when its
        training failed) once no other bracket holds the trial (each ``draw`` holds it in one);
        a PBT exploit ends the member, pruned."""
        trial_id = decision.trial_id
        if trial_id not in self._trials or self._for is not study:
            return
        evidence = getattr(decision, "evidence", None)
        if decision.kind == "draw":
            self._held[trial_id] = self._held.get(trial_id, 0) + 1
        if decision.kind in ("promote", "continue", "stop", "exploit", "answer"):
            self.report(trial_id, getattr(evidence, "value", None), decision.step)
        if isinstance(decision, Stop):
            self._held[trial_id] = self._held.get(trial_id, 1) - 1
            if decision.reason == "failed":
                self.tell(trial_id, None, TrialState.FAIL)  # its training failed: in every bracket
            elif self._held[trial_id] <= 0:
                self.tell(trial_id, None, TrialState.PRUNED)
        elif decision.kind == "exploit":
            self.tell(trial_id, None, TrialState.PRUNED)

    def finished(self, study: Study, final: Sequence[TrialResult]) -> None:
        """The tuner's end: its final results complete their Optuna trials (in trial-id order),
        and any trial still open ends pruned."""
        if self._for is not study or self._tuner is None:
            return
        for r in sorted(final, key=lambda r: r.trial_id):
            value = self._tuner.value(r)
            self.report(r.trial_id, value, r.steps)
            self.tell(r.trial_id, value, TrialState.FAIL if r.failed else TrialState.COMPLETE)
        for trial_id in sorted(self._trials):
            self.tell(trial_id, None, TrialState.PRUNED)
        if study.continues and not study.replaying and self.storage is not None and \
                not isinstance(self.storage, InMemoryStorage):
            self.bring_up_to_date(study)

    def bring_up_to_date(self, study: Study) -> tuple[int, int]:
        """Bring the Optuna study in ``storage`` up to date with the one this run kept in memory
        (a run that continues a study, :attr:`Study.continues`): the tuner asked the same trials
        in the same order as the run that started it, so trial ``k`` of either is the same
        configuration. A trial the earlier run left unfinished (RUNNING: it was killed) gets the
        reports, attributes, state and value it ended with here; the trials it never asked are
        added, numbered as here. Finished trials are left as they are.

        Returns:
            ``(finished, added)``: how many trials were finished and added.

        Warns:
            RuntimeWarning, and writes nothing, when the stored trials' parameters are not this
            run's in the same order (the storage holds another study under the same name).
        """
        assert self._optuna is not None and self._tuner is not None
        storage = get_storage(self.storage)
        kept = create_study(storage=storage, study_name=self.study_name or study.name, load_if_exists=True,
                            direction=_direction(self._tuner))
        stored = kept.get_trials(deepcopy=False)
        here = self._optuna.get_trials(deepcopy=False)
        for old, new in zip(stored, here):
            if old.params != new.params:
                warnings.warn(f"the Optuna study {kept.study_name!r} in `storage` was not brought up to date: its "
                              f"trial {old.number} has the parameters {old.params!r}, but this run asked "
                              f"{new.params!r} (another study under the same name?)", RuntimeWarning, stacklevel=2)
                return 0, 0
        finished, study_id = 0, storage.get_study_id_from_name(kept.study_name)
        for old, new in zip(stored, here):
            if old.state != TrialState.RUNNING or not new.state.is_finished():
                continue
            trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, old.number)
            for step, value in sorted(new.intermediate_values.items()):
                if step not in old.intermediate_values:
                    storage.set_trial_intermediate_value(trial_id, step, value)
            for key, value in new.user_attrs.items():
                if old.user_attrs.get(key) != value:
                    storage.set_trial_user_attr(trial_id, key, value)
            storage.set_trial_state_values(trial_id, new.state, new.values)
            finished += 1
        for new in here[len(stored):]:
            kept.add_trial(new)
        return finished, max(0, len(here) - len(stored))


class OptunaSearch(Tuner):
    """An Optuna sampler as a stagetree tuner on its own (ask-and-tell): ``n_trials``
    configurations, asked ``batch`` at a time (``batch=1``: sequential), each trained to
    ``steps`` and told its ``metric`` before the next batch is asked.

    With ``report_every`` each trial is evaluated every ``report_every`` steps and the value
    reported to the Optuna ``pruner`` (e.g. ``optuna.pruners.MedianPruner()``), which may stop it
    (decision ``stop``, reason "pruned"; otherwise ``continue``, both with the pruner's
    :class:`~events.decisions.Pruned` verdict). The answer is the best trial trained to
    ``steps``. Units: steps. See the module docstring for the space, storage and determinism.

    Raises:
        ValueError: invalid arguments (naming the field and the value), e.g. a ``pruner``
            without ``report_every``.
    """

    recorded_elsewhere = frozenset({"hp_dict", "sampler", "seed", "storage", "study_name", "pruner"})
    """Its space (an :class:`OptunaSpace`) records these in its own settings (the storage, where
    the Optuna study is kept, in none)."""

    def __init__(self, hp_dict: Mapping[str, Any], metric: str, mode: Mode = "max", *, n_trials: int, steps: int,
                 batch: int = 1, sampler: BaseSampler | None = None, seed: int | None = None,
                 storage: str | BaseStorage | None = None, study_name: str | None = None,
                 pruner: BasePruner | None = None, report_every: int | None = None) -> None:
        space = OptunaSpace(hp_dict, n_trials, sampler=sampler, seed=seed, storage=storage, study_name=study_name,
                            pruner=pruner)
        super().__init__(space, metric, mode)
        self.space: OptunaSpace = space
        self.n_trials = space.n
        self.steps = positive_int("steps", steps)
        self.batch = positive_int("batch", batch)
        if report_every is not None:
            positive_int("report_every", report_every)
        elif pruner is not None:
            raise ValueError(f"`pruner` is {pruner!r}, but a pruner needs `report_every` (steps between reports)")
        self.report_every = report_every

    def points(self) -> list[int]:
        """The steps each trial is evaluated at: every ``report_every`` steps, and ``steps``."""
        if self.report_every is None:
            return [self.steps]
        return [*range(self.report_every, self.steps, self.report_every), self.steps]

    async def run(self, study: Study) -> TunerResult:
        points = self.points()
        self.space.optuna_study(study, self)
        pruner = type(self.space.pruner).__name__
        everything: dict[str, TrialResult] = {}
        final: list[TrialResult] = []
        asked = 0
        while asked < self.n_trials:
            configs = self.space.ask(study, self, min(self.batch, self.n_trials - asked))
            if not configs:
                break  # the space has no configuration left that was not asked
            self.draw(study, configs, points[0], indexes=list(range(asked, asked + len(configs))))
            asked += len(configs)
            alive = configs
            for i, step in enumerate(points):
                results = await self._train(study, alive, step)
                alive = []
                for r in results:
                    everything[r.trial_id] = r
                    if r.failed:
                        self.decide(study, Stop(trial_id=r.trial_id, step=step, reason="failed"))
                    elif i + 1 == len(points):
                        final.append(r)
                        self.space.report(r.trial_id, self.value(r), step)
                        self.space.tell(r.trial_id, self.value(r))
                    else:
                        self.space.report(r.trial_id, self.value(r), step)
                        prune = self.space.should_prune(r.trial_id)
                        evidence = Pruned(pruner=pruner, metric=self.metric, mode=self.mode, value=self.value(r),
                                          prune=prune)
                        if prune:
                            self.decide(study, Stop(trial_id=r.trial_id, step=step, reason="pruned", evidence=evidence))
                        else:
                            self.decide(study, Continue(trial_id=r.trial_id, step=step, to_step=points[i + 1],
                                                        evidence=evidence))
                            alive.append(r.hp)
                if not alive:
                    break
        return self._result(study, final, everything)

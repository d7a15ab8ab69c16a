"""The errors the ``stagetree`` command reports, in a module that imports nothing heavy (the
command's error handling must not import torch)."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad command-line input; reported with exit code 2."""


class MetricNotReported(ValueError):
    """An answer lacks the metric the study's tuner reads (a typo in the tuner's ``metric``, or a
    trainer that does not report it); exit code 2, at the first such answer."""


class TrialFailed(RuntimeError):
    """The trial's training raised; ``error`` is the worker's report."""

    def __init__(self, trial_id: str, error: str | None) -> None:
        super().__init__(f"trial {trial_id} failed: {error}")
        self.trial_id = trial_id
        self.error = error


class TrialsFailed(RuntimeError):
    """The study finished and wrote its summary, but some trials failed; exit code 1."""


class RuntimeError_(RuntimeError):
    """The runtime cannot continue; every waiting trial gets this error."""


class StudyTakenOver(RuntimeError_):
    """Another client started driving this client's study on the deployment (a second ``stagetree
    run`` of it): that one continues the study from the log, as after a kill; this one appends
    nothing more and stops (exit code 1)."""

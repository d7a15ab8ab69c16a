"""Optuna with stagetree (``pip install 'stagetree[optuna]'``): stagetree's log as an Optuna
storage (:func:`journal_storage`), and Optuna's samplers as stagetree searchers
(:class:`OptunaSearch`, :class:`OptunaSpace`)."""

from stagetree.integration.optuna.journal import (
    JournalDecodeError,
    KafkaJournalBackend,
    LogJournalBackend,
    RunDirJournalBackend,
    journal_backend,
    journal_storage,
)
from stagetree.integration.optuna.searcher import OptunaSearch, OptunaSpace

__all__ = [
    "JournalDecodeError",
    "KafkaJournalBackend",
    "LogJournalBackend",
    "OptunaSearch",
    "OptunaSpace",
    "RunDirJournalBackend",
    "journal_backend",
    "journal_storage",
]

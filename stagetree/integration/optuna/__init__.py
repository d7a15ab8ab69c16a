"""Optuna with stagetree (``pip install 'stagetree[optuna]'``): stagetree's log as an Optuna
storage (:func:`journal_storage`)."""

from stagetree.integration.optuna.journal import (
    JournalDecodeError,
    KafkaJournalBackend,
    LogJournalBackend,
    RunDirJournalBackend,
    journal_backend,
    journal_storage,
)

__all__ = [
    "JournalDecodeError",
    "KafkaJournalBackend",
    "LogJournalBackend",
    "RunDirJournalBackend",
    "journal_backend",
    "journal_storage",
]

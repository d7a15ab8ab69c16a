"""The HMAC key of the log's hash chain: where a command finds it. Importable without what the
log transports import (see :mod:`stagetree.cli`); :mod:`events.log` exports it as well."""

from __future__ import annotations

import os

KEY_ENV = "STAGETREE_LOG_KEY"
"""The environment variable holding the HMAC secret of the hash chain."""


def secret_from(flag: str | None) -> bytes | None:
    """The chain's HMAC secret: the flag's value, else ``$STAGETREE_LOG_KEY``, else None."""
    value = flag if flag is not None else os.environ.get(KEY_ENV)
    return value.encode() if value else None

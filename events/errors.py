"""The root of the log transports' errors, importable without what the transports import
(pydantic, rocksdict, confluent-kafka): ``stagetree``'s command line catches it around every
command and must stay cheap to import (see :mod:`stagetree.cli`). :mod:`events.log` exports it
as well, with its subclasses."""


class LogError(Exception):
    """Root of log transport errors."""

"""Anchors: a log's hash chain at one record, kept apart from the log.

The hash chain (DESIGN.md invariant 4) catches a record edited, inserted, deleted or moved,
but not a log cut after some record, nor a log rewritten up to some record with its chain
computed again (anyone can, without ``--log-key``), when whatever else would tell (an export's
header, the projection in ``state/``) is cut or rewritten alike. An anchor, ``STREAM@OFFSET:CHAIN``
(the chain after the record at ``OFFSET``, 64 hex characters), is what a Git commit id is to a
repository: ``stagetree run`` prints the plan stream's at the end of a run (and writes it to the
summary as ``log_anchor``), ``replay verify`` prints it for what it verified, and kept anywhere
else (a tracker, a lab notebook, a mail) it lets ``replay verify --anchor`` prove that the log
still holds that record, with everything before it unchanged.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from events import topics
from events.log import EmbeddedLog, Record
from replay.audit import AuditError, Failure, Source

_FORM = re.compile(r"^(?P<stream>[A-Za-z0-9._-]+)@(?P<offset>[0-9]+):(?P<chain>[0-9a-f]{64})$")


@dataclass(frozen=True)
class Anchor:
    """The chain (hex) of ``stream`` after its record at ``offset``."""

    stream: str
    offset: int
    chain: str

    def __str__(self) -> str:
        return f"{self.stream}@{self.offset}:{self.chain}"

    @classmethod
    def parse(cls, text: str, flag: str = "--anchor") -> Anchor:
        """``STREAM@OFFSET:CHAIN`` as :meth:`__str__` writes it.

        Raises:
            ValueError: ``text`` is not of that form (naming ``flag`` and the value).
        """
        match = _FORM.match(text.strip())
        if match is None:
            raise ValueError(f"{flag} is {text!r}, but must be STREAM@OFFSET:CHAIN (CHAIN: 64 lowercase hex "
                             "characters), as `stagetree run` and `stagetree replay verify` print it")
        return cls(match["stream"], int(match["offset"]), match["chain"])

    @classmethod
    def of_record(cls, record: Record) -> Anchor:
        return cls(record.stream, record.offset, record.chain.hex())


def log_anchor(log: EmbeddedLog, stream: str = topics.PLAN) -> Anchor | None:
    """The anchor of ``stream``'s last record in an embedded log (None: the stream is empty)."""
    end = log.end_offset(stream)
    last = next(iter(log.read(stream, end - 1, end)), None) if end > 0 else None
    return None if last is None or not last.chain else Anchor.of_record(last)


def source_anchor(source: Source, stream: str = topics.PLAN) -> Anchor | None:
    """The anchor of ``stream``'s last record in ``source`` (one pass over the stream); None
    when the stream is empty or its records carry no chain (a deployment's sealed topics)."""
    if source.chain == "sealed":
        return None
    last = deque(source.streams.get(stream, []), maxlen=1)
    return Anchor.of_record(last[0]) if last and last[0].chain else None


def check_anchors(source: Source, anchors: Sequence[Anchor]) -> Failure | None:
    """The first of ``anchors`` that ``source`` does not hold: its stream ends before the
    anchored offset (records were cut), or the chain stored after the record there differs (the
    log up to it was rewritten). The chain check proves each stored chain is the one its
    records give, so together they prove the records up to the anchor are the anchored ones.

    Raises:
        AuditError: ``source`` is a deployment's topics (checked by their seals; its records
            carry no chain of their own).
    """
    if anchors and source.chain == "sealed":
        raise AuditError("--anchor: a deployment's topics carry their chain in their seals, not in each record; "
                         "anchor an embedded run directory or its export (a deployment's exports keep its seals too)")
    for anchor in anchors:
        found, last, beyond = _record_at(source.streams.get(anchor.stream, []), anchor.offset)
        if found is None:
            where = ("holds no record" if last < 0 else f"ends at offset {last}") if not beyond else \
                "has no record there"
            return Failure("anchor", anchor.offset, None, (
                f"stream {anchor.stream} {where}, {'before ' if not beyond else 'at '}the anchored record at offset "
                f"{anchor.offset}: the log was cut (anchor {anchor})"))
        if found.chain.hex() != anchor.chain:
            return Failure("anchor", anchor.offset, None, (
                f"stream {anchor.stream}: the chain after offset {anchor.offset} is {found.chain.hex()}, not the "
                f"anchored {anchor.chain}: the log up to there was rewritten, or the anchor is another log's"))
    return None


def _record_at(records: Iterable[Record], offset: int) -> tuple[Record | None, int, bool]:
    """The record at ``offset`` (None: not there), the last offset before it (-1: none), and
    whether the records go on past it."""
    last = -1
    for r in records:
        if r.offset == offset:
            return r, last, True
        if r.offset > offset:
            return None, last, True
        last = r.offset
    return None, last, False

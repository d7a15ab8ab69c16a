"""orjson codec for events, with schema upcasting in one place (STYLE_ANCHORS §6.1).

Wire format: ``{"type", "version", "event_id", "producer", "ts", "trace", "payload"}``.
Decoding validates with pydantic; anything that fails raises :class:`InvalidEvent` with the
reason, which consumers turn into a dead letter instead of crashing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from pydantic import ValidationError

from events.models import EVENT_TYPES, HEADER_FIELDS, Event


class InvalidEvent(ValueError):
    """Raised when bytes are not a valid event of a known type and version; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# (type, from_version) -> function mapping the payload of that version to version + 1.
UPCASTERS: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


def to_dict(event: Event) -> dict[str, Any]:
    """The envelope of ``event`` as plain JSON data."""
    header = event.model_dump(mode="json", include=set(HEADER_FIELDS))
    return {"type": event.type, "version": event.version, **header, "payload": event.payload()}


def encode(event: Event) -> bytes:
    """Serialize ``event`` to UTF-8 JSON bytes (keys sorted, so equal events give equal bytes)."""
    return orjson.dumps(to_dict(event), option=orjson.OPT_SORT_KEYS)


def from_dict(obj: Any) -> Event:
    """Validate an envelope dict into its event class, upcasting old versions first.

    Raises:
        InvalidEvent: unknown type, unsupported version, or fields that fail validation.
    """
    return _from_dict(obj, owned=False)


def _from_dict(obj: Any, owned: bool) -> Event:
    """:func:`from_dict`; ``owned``: ``obj`` was parsed here and nobody else holds it, so its
    payload dict is completed with the header in place instead of copied."""
    if not isinstance(obj, dict):
        raise InvalidEvent(f"event must be a JSON object, got {type(obj).__name__}")
    owned = owned and type(obj) is dict
    etype = obj.get("type")
    cls = EVENT_TYPES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise InvalidEvent(f"unknown event type {etype!r}")
    version = obj.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1 or version > cls.version:
        raise InvalidEvent(f"{etype}: unsupported schema version {version!r} (known: 1..{cls.version})")
    payload = obj.get("payload")
    if not isinstance(payload, dict):
        raise InvalidEvent(f"{etype}: `payload` must be an object, got {payload!r}")
    owned = owned and type(payload) is dict
    while version < cls.version:
        upcast = UPCASTERS.get((etype, version))
        if upcast is None:
            raise InvalidEvent(f"{etype}: no upcaster from version {version}")
        payload = upcast(payload)
        owned = False
        version += 1
    if owned:
        data = payload
        for k in HEADER_FIELDS:  # as {**payload, **header}: the header wins
            if k in obj:
                data[k] = obj[k]
    else:
        data = {**payload, **{k: obj[k] for k in HEADER_FIELDS if k in obj}}
    try:
        return cls.__pydantic_validator__.validate_python(data)  # type: ignore[no-any-return]
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<event>'}: {e['msg']} (value {_quote(e.get('input'))})"
            for e in exc.errors()
        )
        raise InvalidEvent(f"{etype}: {errors}") from None


QUOTE_LIMIT = 200
"""Characters of an offending value quoted in a validation error (records may be megabytes)."""


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= QUOTE_LIMIT else f"{text[:QUOTE_LIMIT]}... ({len(text)} characters)"


def decode(raw: bytes) -> Event:
    """Parse and validate bytes written by :func:`encode`. Raises :class:`InvalidEvent`."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent(f"not JSON: {exc}") from None
    return _from_dict(obj, owned=True)


def encode_batch(events: list[Event]) -> bytes:
    """Serialize events that must be appended together (one atomic batch) as a JSON array of
    envelopes, as a worker sends them to the embedded coordinator."""
    return orjson.dumps([to_dict(e) for e in events], option=orjson.OPT_SORT_KEYS)


def decode_batch(raw: bytes) -> list[Event]:
    """Parse a batch written by :func:`encode_batch`. Raises :class:`InvalidEvent` when the bytes
    are not a non-empty JSON array of valid events (naming the first bad element)."""
    try:
        items = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidEvent(f"not JSON: {exc}") from None
    if not isinstance(items, list) or not items:
        raise InvalidEvent(f"a batch must be a non-empty JSON array of events, got {type(items).__name__}")
    events = []
    for i, item in enumerate(items):
        try:
            events.append(_from_dict(item, owned=True))
        except InvalidEvent as exc:
            raise InvalidEvent(f"batch element {i}: {exc.reason}") from None
    return events

"""Typed errors of the buffers layer; each leaves the object unchanged."""

from __future__ import annotations

from buffers.checks import setting_message

__all__ = [
    "BuffersError",
    "SlotError",
    "DoubleFree",
    "SlotNotOwned",
    "SlotOutOfRange",
    "SlotQuarantined",
    "NotQuarantined",
    "LayoutError",
    "GeometryMismatch",
    "BadArgument",
    "BadArgumentType",
    "RowOverflow",
    "BadSetting",
    "BadSettingType",
]


class BuffersError(Exception):
    """Base class of every error raised by :mod:`buffers`."""


class SlotError(BuffersError):
    pass


class DoubleFree(SlotError):
    def __init__(self, slot: int, room: int) -> None:
        self.slot, self.room = slot, room
        super().__init__(
            f"metadata slot {slot} freed by room={room} but it is already free: a double "
            "free would let two live requests share one row. Free a slot exactly once, "
            "when its request leaves the last queue."
        )


class SlotNotOwned(SlotError):
    def __init__(self, slot: int, room: int, owner: int) -> None:
        self.slot, self.room, self.owner = slot, room, owner
        super().__init__(
            f"metadata slot {slot} freed by room={room} but it belongs to room={owner}; "
            "nothing was freed. Free the slot with the room that allocated it."
        )


class SlotOutOfRange(SlotError):
    def __init__(self, slot: int, size: int) -> None:
        self.slot, self.size = slot, size
        super().__init__(f"metadata slot {slot} is outside the pool of {size} rows (0..{size - 1})")


class SlotQuarantined(SlotError):
    def __init__(self, slot: int) -> None:
        self.slot = slot
        super().__init__(
            f"metadata slot {slot} is quarantined (freed while a remote writer may still be "
            "writing); release() it once the writer has drained"
        )


class NotQuarantined(SlotError):
    def __init__(self, slot: int) -> None:
        self.slot = slot
        super().__init__(f"metadata slot {slot} is not quarantined; nothing to release")


class LayoutError(BuffersError):
    pass


class RowOverflow(LayoutError, RuntimeError):
    """More values than a metadata row holds; nothing was written. Also a
    RuntimeError, which is what callers of row-copying code usually catch."""

    def __init__(self, field: str, count: int, width: int, hint: str = "") -> None:
        self.field, self.count, self.width = field, count, width
        super().__init__(
            hint
            or (
                f"metadata field {field}: {count} values do not fit its row of {width}; "
                f"write at most {width} values or widen the field in the layout. "
                "Nothing was written."
            )
        )


class GeometryMismatch(BuffersError):
    def __init__(self, what: str, target: object, draft: object) -> None:
        self.what, self.target, self.draft = what, target, draft
        super().__init__(
            f"draft state cannot ride along with the target's: {what} differs "
            f"(target {target!r}, draft {draft!r}); give the draft model its own transfer"
        )


class BadArgument(BuffersError, ValueError):
    """A value of the wrong type or range was handed in; nothing changed."""

    def __init__(self, what: str, value: object, expected: str) -> None:
        self.what, self.value, self.expected = what, value, expected
        super().__init__(
            f"{what}: got {value!r} ({type(value).__name__}), expected {expected}. "
            "Nothing was changed."
        )


class BadArgumentType(BadArgument, TypeError):
    """An argument of the wrong type (also a TypeError); nothing changed."""


class BadSetting(LayoutError, BadArgument):
    """A field of a settings class (:class:`~buffers.kv_args.KVArgs`, a state
    component) of the wrong range, or fields that do not fit together; nothing
    was built. ``field`` is the field's name, ``allowed`` what it accepts."""

    def __init__(self, field: str, value: object, allowed: str, owner: str = "") -> None:
        self.field, self.owner, self.allowed = field, owner, allowed
        self.what, self.value, self.expected = (
            f"{owner}.{field}" if owner else field,
            value,
            allowed,
        )
        BuffersError.__init__(
            self, setting_message(field, value, allowed, owner) + "; nothing was built"
        )


class BadSettingType(BadSetting, BadArgumentType):
    """A settings field of the wrong type (also a TypeError); nothing was built."""

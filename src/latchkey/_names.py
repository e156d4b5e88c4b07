"""Lock and record names: any non-empty UTF-8 string of at most 255 bytes."""

from __future__ import annotations

from latchkey.errors import InvalidName

MAX_NAME_BYTES = 255


def validate_name(name: object) -> str:
    """Return ``name`` if it is a valid lock name, else raise :class:`InvalidName`.

    Quotes, ``;``, NUL and any other character are allowed: escaping is each store's job.
    """
    if not isinstance(name, str):
        raise InvalidName(f"lock name must be a str, got {type(name).__name__} {name!r}")
    if not name:
        raise InvalidName("lock name must not be empty")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidName(f"lock name {name!r} is not valid UTF-8 ({exc.reason})") from None
    if size > MAX_NAME_BYTES:
        raise InvalidName(
            f"lock name {name[:40]!r}… is {size} bytes of UTF-8; the limit is {MAX_NAME_BYTES}"
        )
    return name

"""Request bodies: large ones are decoded in a worker thread, never on the event loop.

Litestar decodes a JSON body on the event loop: first into Python objects, then into the
handler's msgspec Struct. For a 15 MB body of many small values that is a second or more
during which no other connection is served (not even /health). `ApiRequest` decodes bodies of
`OFF_LOOP_BYTES` or more in a thread, straight into the handler's `data` type; Litestar's own
conversion then passes the finished Struct through in O(1). Errors keep Litestar's shapes
(a ValidationException naming the field, a SerializationException for bad JSON), so a client
gets the same 400 for a large body as for a small one.
"""

from __future__ import annotations

import re
import time
from typing import Any

import anyio
import msgspec
from litestar import Request
from litestar.exceptions import SerializationException, ValidationException
from litestar.types import Empty

# Below this, decoding costs well under a millisecond per KiB and the thread hop is not worth it.
OFF_LOOP_BYTES = 64 << 10

_AT = re.compile(r"`\$\.(.+)`$")  # where msgspec says the error is: "... - at `$.a[0].b`"


class ApiRequest(Request):  # type: ignore[type-arg]
    """The app's request class: `json()` decodes large bodies off the event loop, and
    `received_at` (time.monotonic()) is when routing made it, before the body is read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.received_at = time.monotonic()

    async def json(self) -> Any:
        if self._json is Empty and self._connection_state.json is Empty:
            body = await self.body()
            if len(body) >= OFF_LOOP_BYTES:
                field = self.route_handler.parsed_data_field
                target = Any if field is None else field.annotation
                value = await anyio.to_thread.run_sync(decode_body, body, target)
                # Litestar's caches of the decoded body (the same ones super().json() fills)
                self._json = self._connection_state.json = value
        return await super().json()


def decode_body(body: bytes, target: Any) -> Any:
    """`body` decoded into `target` as Litestar would (lax coercion), in the caller's thread."""
    try:
        return msgspec.json.decode(body, type=target, strict=False)
    except msgspec.ValidationError as exc:
        message, _, where = str(exc).partition(" - ")
        found = _AT.search(where)
        raise ValidationException(
            detail="Validation failed",
            extra=[{"message": message, "key": found.group(1) if found else "data"}],
        ) from None
    except msgspec.DecodeError as exc:
        raise SerializationException(str(exc)) from None

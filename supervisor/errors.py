"""Errors the daemon answers requests with.

    SessiondError(code, message)        answered as ipc Error{code, message}
    ├── NotFound                        not_found: no such session
    ├── BadRequest                      bad_request: malformed or invalid arguments
    ├── Conflict                        conflict: the session's state forbids it now
    ├── Capacity                        capacity: no room for another live worker
    ├── LimitError                      limit_exceeded
    ├── PermissionDenied                permission_denied
    ├── NoSpace                         no_space: the state directory's disk is full
    └── Internal                        internal: our fault (zygote gone, I/O error)

Anything else escaping a request handler is logged with its traceback and
answered as `internal`; the daemon never dies of one request.
"""

from __future__ import annotations

from ipc.messages import ErrorCode

__all__ = [
    "BadRequest",
    "Capacity",
    "Conflict",
    "Internal",
    "LimitError",
    "NoSpace",
    "NotFound",
    "PermissionDenied",
    "SessiondError",
]


class SessiondError(Exception):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(SessiondError):
    code = ErrorCode.NOT_FOUND


class BadRequest(SessiondError):
    code = ErrorCode.BAD_REQUEST


class Conflict(SessiondError):
    code = ErrorCode.CONFLICT


class Capacity(SessiondError):
    code = ErrorCode.CAPACITY


class LimitError(SessiondError):
    code = ErrorCode.LIMIT_EXCEEDED


class PermissionDenied(SessiondError):
    code = ErrorCode.PERMISSION_DENIED


class Internal(SessiondError):
    code = ErrorCode.INTERNAL


class NoSpace(SessiondError):
    """Nothing was saved for want of space.  Sent as `internal` to clients
    that did not say they know `no_space` (see ipc.messages.NEW_ERROR_CODES)."""

    code = ErrorCode.NO_SPACE

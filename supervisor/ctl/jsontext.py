"""`json.dumps` for sessionctl's one-shot path (supervisor.ctl.fast), without
importing json: the same bytes for plain data, from json.dumps's own C
encoder (the `json` package imports `re`, ~10 ms of a 50 ms `ls`).  Runs in
sessionctl's process."""

from __future__ import annotations

from supervisor.ctl.errors import Unsure as _Unsure

TYPE_CHECKING = False
if TYPE_CHECKING:  # (as in supervisor.ctl.fast: typing is not imported at run time)
    from collections.abc import Callable
    from typing import Any

__all__ = ["json_text", "python_json_text"]


def _quote_py(s: str) -> str:
    import json.encoder  # (only where the C accelerator is missing)

    return json.encoder.py_encode_basestring_ascii(s)


try:  # what json.dumps itself runs on: its C accelerator's string quoting and encoder
    import _json
except ImportError:  # pragma: no cover (CPython has it)
    _json = None  # type: ignore[assignment]
_quote: Callable[[str], str] = _quote_py if _json is None else _json.encode_basestring_ascii


def _not_plain(obj: object) -> object:
    raise _Unsure(f"{type(obj).__name__} in JSON output")


def json_text(obj: Any) -> str:
    """`json.dumps(obj)` for plain data (dicts with str keys, lists, str,
    int, float, bool, None), the same bytes, without importing json (and
    re, ~10 ms of start-up): json.dumps's own C encoder, set up as
    json.dumps sets it up, or where that is missing or differs, the same
    rules in Python.  Raises _Unsure for anything else."""
    if _json is not None:
        try:
            encode = _json.make_encoder({}, _not_plain, _quote, None, ": ", ", ", False, False, True)
        except TypeError:  # pragma: no cover (another Python's signature)
            pass
        else:
            try:
                return "".join(encode(obj, 0))
            except (TypeError, ValueError) as exc:  # e.g. a key that is not a str
                raise _Unsure(str(exc)) from None
    return python_json_text(obj)


def python_json_text(obj: Any) -> str:
    """json_text without the C encoder."""
    parts: list[str] = []
    _write(obj, parts.append, {})
    return "".join(parts)


def _float_text(f: float) -> str:
    # As json.encoder's floatstr with allow_nan=True.
    if f != f:
        return "NaN"
    if f == float("inf"):
        return "Infinity"
    if f == -float("inf"):
        return "-Infinity"
    return float.__repr__(f)


def _write(obj: Any, out: Callable[[str], None], keys: dict[str, str]) -> None:
    t = type(obj)
    if t is str:
        out(_quote(obj))
    elif obj is None:
        out("null")
    elif obj is True:
        out("true")
    elif obj is False:
        out("false")
    elif t is int:
        out(int.__repr__(obj))
    elif t is float:
        out(_float_text(obj))
    elif t is dict:
        if not obj:
            out("{}")
            return
        sep = "{"
        for k, v in obj.items():
            if type(k) is not str:
                raise _Unsure("a key that is not a str")
            key = keys.get(k)
            if key is None:
                key = keys[k] = _quote(k) + ": "
            out(sep)
            out(key)
            _write(v, out, keys)
            sep = ", "
        out("}")
    elif t is list:
        if not obj:
            out("[]")
            return
        sep = "["
        for v in obj:
            out(sep)
            _write(v, out, keys)
            sep = ", "
        out("]")
    else:
        raise _Unsure(f"{t.__name__} in JSON output")

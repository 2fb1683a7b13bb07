"""A bound on the regular expressions config documents may hold (``module_name_regex``).

Python's ``re`` backtracks: ``(a|a)*!`` takes twice as long for every character of a module name
(a 35-character Hugging Face path would take hours), and a backreference makes matching NP-hard.
A document is untrusted, so its regexes are checked before they are used, on the parsed pattern:

* at most :data:`MAX_LENGTH` characters;
* no backreference or conditional group (``\\1``, ``(?P=name)``, ``(?(1)a|b)``);
* no repeat (``*``, ``+``, ``{m,n}`` with n > 1) around another repeat or an alternation, at any
  depth: the star height stays 1, so no exponential backtracking;
* at most :data:`MAX_REPEATS` repeats in all, which bounds the backtracking of the remaining
  shapes (``.*.*.*``) to a polynomial of that degree in the length of the module path.

What remains matches ``layers\\.\\d+\\.attn``, ``(encoder|decoder)\\..*fc[12]`` and the like.
"""

from __future__ import annotations

import re
from typing import Any

from qplug_core.errors import ConfigValidationError

try:  # the stdlib's own parser of regular expressions (sre_parse before Python 3.11)
    from re import _constants as _sre  # type: ignore[attr-defined]
    from re import _parser as _parse_module  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _sre  # type: ignore[no-redef]
    import sre_parse as _parse_module  # type: ignore[no-redef]

__all__ = ["MAX_LENGTH", "MAX_REPEATS", "check_bounded_regex"]

#: longest regex a document may hold
MAX_LENGTH = 256
#: most repeats (``*``, ``+``, ``{m,n}`` with n > 1) in one regex
MAX_REPEATS = 3
_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}
_REFERENCES = {_sre.GROUPREF, _sre.GROUPREF_EXISTS, _sre.GROUPREF_IGNORE,
               getattr(_sre, "GROUPREF_LOC_IGNORE", _sre.GROUPREF),
               getattr(_sre, "GROUPREF_UNI_IGNORE", _sre.GROUPREF)}


def _children(op: Any, av: Any) -> list[Any]:
    """The sub-patterns below one parsed item."""
    if op is _sre.BRANCH:
        return list(av[1])
    if op is _sre.SUBPATTERN:
        return [av[-1]]
    if op in _REPEATS:
        return [av[2]]
    if op in (_sre.ASSERT, _sre.ASSERT_NOT):
        return [av[1]]
    if op is getattr(_sre, "ATOMIC_GROUP", None):
        return [av]
    return []


def _walk(pattern: Any, inside_repeat: bool, counts: list[int], fail: Any) -> None:
    for op, av in pattern:
        if op in _REFERENCES:
            fail("backreferences and conditional groups make matching exponential")
        repeat = op in _REPEATS and av[1] > 1
        if inside_repeat and (repeat or op is _sre.BRANCH):
            fail("a repeated part may not hold another repeat or an alternation ('|'): that makes "
                 "matching take exponential time")
        if repeat:
            counts[0] += 1
        for sub in _children(op, av):
            _walk(sub, inside_repeat or repeat, counts, fail)


def check_bounded_regex(text: Any, field: str) -> re.Pattern[str]:
    """The compiled ``text``, if it is within the bound; else a :class:`ConfigValidationError`
    naming ``field``."""

    def fail(reason: str) -> None:
        raise ConfigValidationError(f"{field} {text!r} is refused: {reason} (documents may hold "
                                    f"regexes of at most {MAX_LENGTH} characters, {MAX_REPEATS} "
                                    "repeats, no nested repeats or repeated alternations, no "
                                    "backreferences)", field=field, value=text)

    if not isinstance(text, str):
        raise ConfigValidationError(f"{field} must be a string, got {type(text).__name__}",
                                    field=field, value=text)
    if len(text) > MAX_LENGTH:
        fail(f"it has {len(text)} characters")
    try:
        compiled = re.compile(text)
        parsed = _parse_module.parse(text)
    except re.error as exc:
        raise ConfigValidationError(f"{field} {text!r} is not a valid regular expression: {exc}",
                                    field=field, value=text) from exc
    counts = [0]
    _walk(parsed, False, counts, fail)
    if counts[0] > MAX_REPEATS:
        fail(f"it has {counts[0]} repeats")
    return compiled

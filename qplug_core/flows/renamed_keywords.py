"""Keyword arguments renamed for one spelling across the public API, the old names still accepted.

Every entry point that takes the batches observers or scales are measured on calls them
``calibration_data`` (``qp.quantize``'s name since the first release), and ``data`` always means
batches a result is scored on (``qp.sensitivity``, ``qp.Target``). Siblings that said
``calibration`` (or ``data`` for calibration batches) keep working with a ``DeprecationWarning``
naming the new keyword.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from qplug_core.errors import ConfigValidationError, warn_user

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keywords(**old_to_new: str) -> Callable[[F], F]:
    """Accept each ``old=`` keyword as ``new=``, warning once per call that ``old`` is deprecated."""
    def decorate(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if new in kwargs:
                    raise ConfigValidationError(f"{func.__name__}() got both {new}= and its old name {old}=: "
                                                f"pass {new}= only", field=new, value=None)
                warn_user(f"{func.__name__}({old}=...) is deprecated: the keyword is now {new}= (one name "
                          "for calibration batches across qplug's API)", DeprecationWarning)
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)
        return wrapper  # type: ignore[return-value]
    return decorate

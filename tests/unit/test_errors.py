"""qplug's warning channel (``qplug_core/errors.py``)."""

from __future__ import annotations

import warnings

from qplug_core.errors import warn_user


def test_every_warning_starts_with_qplug_once_and_points_at_the_caller():
    """Users filter qplug's warnings on 'qplug:'; messages written without it get it, once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_user("a layer stays float")
        warn_user("qplug: said already", RuntimeWarning)
    assert [(str(w.message), w.category) for w in caught] == [("qplug: a layer stays float", UserWarning),
                                                               ("qplug: said already", RuntimeWarning)]
    assert {w.filename for w in caught} == {__file__}

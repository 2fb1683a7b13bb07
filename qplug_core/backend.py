"""Backend declarations (what a plugin registers) and assembled backends (what the flows use)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on this machine, and if not, why (one line a user can act on)."""

    ok: bool
    reason: str = ""


def always_available() -> Availability:
    return Availability(True)


@dataclass(frozen=True)
class BackendSpec:
    """A backend as a plugin declares it through ``qplug_register_backends``.

    ``engine`` is the ``torch.backends.quantized`` engine its kernels pack weights for (``None`` for
    backends that need no engine, like ``reference``).
    """

    name: str
    description: str
    engine: str | None = None
    is_available: Callable[[], Availability] = field(default=always_available, compare=False)

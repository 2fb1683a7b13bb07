"""A torch.fx Tracer that only traces the thread that called :meth:`trace`.

While fx traces, it patches ``nn.Module.__call__`` and ``nn.Module.__getattr__`` for the whole
process. Another thread running a model at that moment (qplug calibrating or checking kernels for
another backend, or the user's own code) would have its module calls recorded into this trace or
fail inside the tracer. Traces therefore run one at a time (:data:`TRACE_LOCK`), and calls the
patches intercept from other threads go straight to the module, untouched.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from torch import nn
from torch.fx import Tracer

#: the patches fx installs are process-wide: one symbolic trace at a time
TRACE_LOCK = threading.RLock()


class ThreadConfinedTracer(Tracer):
    """fx's Tracer, serialised by :data:`TRACE_LOCK` and blind to other threads."""

    _tracing_thread: int | None = None

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> Any:
        with TRACE_LOCK:
            self._tracing_thread = threading.get_ident()
            try:
                return super().trace(root, concrete_args)
            finally:
                self._tracing_thread = None

    def foreign_thread(self) -> bool:
        """Whether the caller is not the thread tracing (subclasses overriding ``call_module``
        must check this first and then just call ``forward``)."""
        return threading.get_ident() != self._tracing_thread

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        if self.foreign_thread():
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self.foreign_thread():
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

"""A GraphModule whose call fails gets to say why, at no cost to the calls that succeed.

torch.fx runs every call of a GraphModule through the ``_wrapped_call`` of its class (each instance
has a class of its own), which prints the generated code around a failing line on stderr ("Call
using an FX-traced Module") and re-raises. That object calls the class's own ``__call__`` where it
has one (its ``cls_call``, which torch.export's dynamo capture sets the same way):
:func:`explain_failures` puts a function there whose ``try`` costs nothing while the call succeeds
(Python 3.11's zero-cost exceptions). An error it raises instead is raised from this function's
frame, so torch prints no generated code for it; an error it leaves alone is re-raised as it was.
``recompile()`` keeps the class's ``_wrapped_call``, and a module whose code is not generated yet
(``ir/deferred_code.py``) has none: its first ``recompile()`` finds the function as the class's
``__call__`` and wraps it. Deep copies (a new class each) get it again.

qplug's own calls of a GraphModule that may fail on a caller's inputs (a partition's reference form,
the read of a table's ids) go through :func:`quiet_call` instead, which skips that printout and
leaves the error to its caller.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator
from typing import Any

from torch import fx, nn

__all__ = ["Explain", "explain_failures", "failed_module_calls", "quiet_call"]

#: the frame of a module's call: its locals hold the module (``self``) and what its forward got (``args``)
_MODULE_CALL = nn.Module._call_impl.__code__

#: ``(model, args, kwargs, error) -> the error to raise instead`` (from ``error``), or None
Explain = Callable[[fx.GraphModule, tuple, dict, Exception], "Exception | None"]


def explain_failures(gm: fx.GraphModule, explain: Explain) -> None:
    """Where a call of ``gm`` raises, raise ``explain(gm, args, kwargs, error)`` from the error
    instead when it gives one (only this instance: its class is its own); idempotent."""
    cls = type(gm)
    if cls is fx.GraphModule:  # never patch the shared base class
        return
    call = _explained_call(cls, explain)
    wrapped = vars(cls).get("_wrapped_call")
    if wrapped is None:  # no code generated yet: the first recompile() wraps the class's __call__
        cls.__call__ = call  # type: ignore[method-assign]
    else:
        wrapped.cls_call = call
    if not any(isinstance(hook, _ExplainCopies) for hook in getattr(gm, "_deepcopy_hooks", ())):
        register = getattr(gm, "_register_deepcopy_hook", None)
        if register is not None:  # torch before 2.5 copies the model without it
            register(_ExplainCopies(explain))


def _explained_call(cls: type, explain: Explain) -> Callable[..., Any]:
    def explained_call(obj: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        try:
            return super(cls, obj).__call__(*args, **kwargs)
        except Exception as error:
            try:
                instead = explain(obj, args, kwargs, error)
            except Exception:  # noqa: BLE001 - an explanation that fails hides nothing: the error stands
                instead = None
            if instead is None:
                raise
            raise instead from error

    return explained_call


def failed_module_calls(error: BaseException) -> Iterator[tuple[Any, tuple]]:
    """The modules whose calls ``error`` passed through, outermost first, each with the positional
    arguments its call got: read from the traceback once a call failed, at no cost before."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code is _MODULE_CALL:
            yield frame.f_locals.get("self"), frame.f_locals.get("args", ())


class _ExplainCopies:
    """A GraphModule deep-copy hook: the copy explains its failures as the model does."""

    def __init__(self, explain: Explain) -> None:
        self.explain = explain

    def __call__(self, copy: fx.GraphModule) -> None:
        explain_failures(copy, self.explain)


def quiet_call(form: Callable[..., Any], inputs: tuple) -> Any:
    """``form(*inputs)``; a GraphModule is called as a plain module (its hooks run), so that a
    failure prints none of its generated code on stderr (at every such request of a server): the
    caller handles the error."""
    if isinstance(form, fx.GraphModule):
        return nn.Module.__call__(form, *inputs)
    return form(*inputs)

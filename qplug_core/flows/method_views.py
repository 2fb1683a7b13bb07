"""A module's other method (``model.get_image_features``) quantized as if it were its forward.

A graph is captured from ``forward`` only, so a quantized ``CLIPModel`` answered ``forward`` and lost
the ``get_image_features`` / ``get_text_features`` image search calls. ``qp.quantize`` takes such a
bound method (and a ``functools.partial`` of a module or bound method, whose keywords the capture
fixes: ``interpolate_pos_encoding=False``) by capturing a view of its module whose ``forward`` is
that method; ``self(x)`` inside the method (``predict_proba`` built on ``forward``) is the module's
own forward. A keyword the method does not take is refused by name before capture. The view shares the module's parameters and submodules (no copy of the weights);
their containers are its own, so nothing done to the view reaches the user's model. A partial's
``forward`` takes ``*args``, which symbolic tracing cannot read: ``capture="auto"`` exports it.
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

from torch import nn

from qplug_core.errors import ConfigValidationError, did_you_mean

__all__ = ["method_view"]


def method_view(call: Any) -> Any:
    """``call`` as a module to capture when it is a bound method of a module or a partial of one
    (or of the module itself); anything else as it is."""
    keywords: dict[str, Any] = {}
    if isinstance(call, functools.partial):
        if call.args:
            raise ConfigValidationError(
                "qp.quantize takes a functools.partial with keyword arguments only (they are fixed in "
                f"the captured graph); got {len(call.args)} positional: put them in example_inputs",
                field="model", value="functools.partial")
        keywords, call = dict(call.keywords), call.func
        if isinstance(call, nn.Module):
            return _view(call, type(call).forward, keywords)
    if inspect.ismethod(call) and isinstance(call.__self__, nn.Module):
        return _view(call.__self__, call.__func__, keywords)
    return call


def _view(owner: nn.Module, function: Any, keywords: dict[str, Any]) -> nn.Module:
    """A module of a subclass of ``owner``'s class whose ``forward`` is ``function`` (called with
    ``keywords``), holding ``owner``'s state in containers of its own."""
    cls = type(owner)
    view_class = type(cls.__name__, (cls,), {"forward": _entered_once(cls, function, keywords),
                                             "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    view = view_class.__new__(view_class)
    view.__dict__.update({key: copy.copy(value) if isinstance(value, (dict, set, list)) else value
                          for key, value in vars(owner).items()})
    view.__dict__[_IN_METHOD] = False
    return view


#: set on a view while its method runs, so that ``self(x)`` in the method reaches the class's forward
_IN_METHOD = "_qplug_in_method"


def _entered_once(cls: type, function: Any, keywords: dict[str, Any]) -> Any:
    """``function`` as the view's outermost ``forward``; a call of ``self(...)`` or ``self.forward(...)``
    inside it (``predict_proba`` built on ``forward``) runs ``cls.forward``, not the method again."""
    method = _with_keywords(function, keywords) if keywords else function

    @functools.wraps(method)  # symbolic tracing reads the method's parameters through __wrapped__
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__[_IN_METHOD]:
            return cls.forward(self, *args, **kwargs)
        self.__dict__[_IN_METHOD] = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self.__dict__[_IN_METHOD] = False

    return forward


def _with_keywords(function: Any, keywords: dict[str, Any]) -> Any:
    """``function`` with ``keywords`` given, and the signature saying so (the capture reads the
    fixed values from it, and the int8 model then takes a call giving them)."""
    signature = inspect.signature(function)
    _check_keywords(function, signature, keywords)
    shown = _keywords_shown(inspect.signature(functools.partial(function, **keywords)), keywords)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return function(self, *args, **{**keywords, **kwargs})

    forward.__signature__ = shown  # type: ignore[attr-defined]
    forward.__name__ = getattr(function, "__name__", "forward")
    return forward


def _check_keywords(function: Any, signature: inspect.Signature, keywords: dict[str, Any]) -> None:
    """Refuse a partial's keyword that ``function`` does not take (a typo would otherwise surface
    as a capture failure, far from its cause)."""
    kinds = {p.kind for p in signature.parameters.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds:
        return
    takes = [name for name, p in signature.parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name != "self"]
    for key in keywords:
        if key not in takes:
            raise ConfigValidationError(
                f"{function.__qualname__}() has no parameter {key!r}{did_you_mean(key, takes)}, which the "
                f"functools.partial given to qp.quantize fixes; it takes {', '.join(takes) or 'no keywords'}",
                field="model", value=key)


def _keywords_shown(signature: inspect.Signature, keywords: dict[str, Any]) -> inspect.Signature:
    """``signature`` with a keyword-only parameter for each of ``keywords`` that ``**kwargs`` takes
    (``output_hidden_states=True`` given to Hugging Face's ``get_image_features``)."""
    parameters = list(signature.parameters.values())
    extra = [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=value)
             for key, value in keywords.items() if key not in signature.parameters]
    if not extra:
        return signature
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    return signature.replace(parameters=[*parameters[:at], *extra, *parameters[at:]])

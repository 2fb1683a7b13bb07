"""A swapped-in layer whose call fails names itself and the input at fault, as its float layer fails.

``qp.quantize_dynamic`` and ``qp.quantize_weights`` put their layers into the user's own model
object, so no converted graph explains their failures (``flows/input_faults.py``): a wrong feature
size met fbgemm's, torch's or ONNX Runtime's packed-weight message, an id outside a weight-only
table torch's index error, a float64 input qplug's refusal; none named the layer, and qplug's
refusals escaped a caller's ``except RuntimeError`` that caught the float model's. Nothing is
checked while calls succeed (:meth:`ExplainedLayer.__call__`'s ``try`` costs nothing then); when
one fails, the layer's :meth:`~ExplainedLayer.input_fault` compares the inputs with what it takes,
and a fault it finds is raised, from the error, as :class:`InputMismatchError` naming the layer
(its name in the quantized model, given by :func:`name_layers`) that is also of the builtin type
the float layer raises for that fault. An error no fault explains is raised as it was.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from qplug_core.errors import InputMismatchError, QplugError, first_line, input_mismatch

__all__ = ["ExplainedLayer", "Fault", "dtype_refusal", "explained_error", "first_input", "ids_outside", "name_layers",
           "not_ids", "wrong_dtype", "wrong_rank", "wrong_width"]

#: (the builtin error type the float layer raises for the fault, what is wrong with the input)
Fault = tuple[type[Exception], str]


class ExplainedLayer(nn.Module):
    """A layer put in place of a float one whose failed calls say which layer and what input."""

    #: its name in the model it was swapped into (:func:`name_layers`); None: made on its own
    layer_name: str | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as error:
            instead = self._explained(args, kwargs, error)
            if instead is None:
                raise
            raise instead from error

    def input_fault(self, args: tuple, kwargs: dict) -> Fault | None:
        """What is wrong with a failed call's inputs, if this layer can tell (override)."""
        return None

    def _explained(self, args: tuple, kwargs: dict, error: Exception) -> InputMismatchError | None:
        return explained_error(self, self.layer_name, error, lambda: self.input_fault(args, kwargs))


def explained_error(layer: nn.Module, name: str | None, error: Exception, fault: Callable[[], Fault | None]
                    ) -> InputMismatchError | None:
    """The error ``layer`` (called ``name`` in its model) raises instead of ``error``, given what is
    wrong with the call's inputs (``fault()``), or None to raise ``error`` as it is."""
    own = isinstance(error, InputMismatchError)  # the kernel's own refusal of the input
    if (isinstance(error, QplugError) and not own) or getattr(error, "layer", None) is not None:
        return None  # qplug refusing something else (a cast model, a trace), or a layer inside explained it
    try:
        found = fault()
    except Exception:  # noqa: BLE001 - an explanation that fails hides nothing: the error stands
        found = None
    label = f"layer {name!r} ({type(layer).__name__})" if name else type(layer).__name__
    if own:  # its words stand, with the layer's name (and the float layer's type where it fails too)
        message = f"{label}: {error}"
        instead = input_mismatch(message, found[0] if found else _builtin_of(error))
    elif found is None:
        return None
    else:
        builtin, why = found
        instead = input_mismatch(f"{label} {why} (it raised {type(error).__name__}: "
                                 f"{first_line(error)[:200]})", builtin)
    instead.layer = name or type(layer).__name__  # type: ignore[attr-defined]
    return instead


def _builtin_of(error: Exception) -> type[Exception]:
    """The builtin error type ``error`` also is (:func:`input_mismatch`), else its own type."""
    return next((c for c in type(error).__mro__ if c.__module__ == "builtins" and c is not Exception
                 and issubclass(c, Exception)), type(error))


def name_layers(model: nn.Module) -> None:
    """Give every :class:`ExplainedLayer` of ``model`` its name there, for its failed calls to say."""
    for name, module in model.named_modules():
        if isinstance(module, ExplainedLayer):
            module.layer_name = name or None


def first_input(args: tuple, kwargs: dict, name: str) -> Any:
    """A call's first input, given by position or as ``name``."""
    return args[0] if args else kwargs.get(name)


def _shape(x: torch.Tensor) -> str:
    return str(tuple(x.shape))


def wrong_width(x: Any, features: int, builtin: type[Exception] = RuntimeError) -> Fault | None:
    """The fault of a tensor whose last dimension is not ``features`` wide (None if it is)."""
    if not isinstance(x, torch.Tensor) or (x.dim() and x.shape[-1] == features):
        return None
    return builtin, (f"takes inputs with {features} features in the last dimension, got shape {_shape(x)}: "
                     "the model's inputs do not have the shape it was quantized with")


def wrong_rank(x: Any, ranks: tuple[int, ...], builtin: type[Exception] = ValueError) -> Fault | None:
    """The fault of a tensor whose number of dimensions is none of ``ranks`` (None if it is one)."""
    if not isinstance(x, torch.Tensor) or x.dim() in ranks:
        return None
    return builtin, f"takes {' or '.join(f'{r}-D' for r in ranks)} inputs, got shape {_shape(x)}"


def wrong_dtype(x: Any, dtype: torch.dtype, builtin: type[Exception] = RuntimeError) -> Fault | None:
    """The fault of a tensor not of ``dtype`` (None if it is)."""
    if not isinstance(x, torch.Tensor) or x.dtype is dtype:
        return None
    wanted = str(dtype).removeprefix("torch.")
    return builtin, (f"takes {wanted} inputs, got {str(x.dtype).removeprefix('torch.')} of shape "
                     f"{_shape(x)}: pass it .to(torch.{wanted}), as the float model takes it")


def dtype_refusal(kernel: str, x: torch.Tensor, dtype: torch.dtype) -> InputMismatchError:
    """The refusal of ``x`` (not of ``dtype``) by ``kernel``, which computes for ``dtype`` only, as the
    float layer it replaced takes only that one: raise it after comparing dtypes, all a fitting call
    pays (its layer adds its name and the float layer's error type, :class:`ExplainedLayer`)."""
    fault = wrong_dtype(x, dtype)
    return InputMismatchError(f"{kernel} {fault[1] if fault else ''}")


def not_ids(ids: Any) -> Fault | None:
    """The fault of a tensor not of int64 or int32 ids, which torch's embeddings refuse with a
    RuntimeError (None if it is of those)."""
    if not isinstance(ids, torch.Tensor) or ids.dtype in (torch.int64, torch.int32):
        return None
    return RuntimeError, (f"takes int64 or int32 ids, got {str(ids.dtype).removeprefix('torch.')} of shape "
                          f"{_shape(ids)}: pass token ids, as the float model takes them")


def ids_outside(ids: Any, rows: int, builtin: type[Exception]) -> Fault | None:
    """The fault of integer ids outside a table of ``rows`` rows (None where all are inside)."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or not ids.numel():
        return None
    low, high = int(ids.min()), int(ids.max())
    if low >= 0 and high < rows:
        return None
    return builtin, (f"was given ids from {low} to {high}, but its table has {rows} rows (ids 0 to {rows - 1}): "
                     "pass ids of the vocabulary the model was built with (the same tokenizer)")

"""A converted model's call that fails says which input is at fault, the same on every backend.

An int8 BERT given ids of rank 1, an id outside its vocabulary or a sequence longer than its
position table failed deep inside: torch's ``IndexError``/``RuntimeError`` under torch.fx's
printout of generated code on fbgemm, ONNX Runtime's ``InvalidArgument``/``Fail`` (wrapped as
:class:`DelegateRuntimeError`) on a delegating backend, each wording it otherwise and none naming
the input. The entry checks (``exported_inputs.py``, ``input_dtypes.py``) cannot refuse these
up front: a symbolically traced model may rightly take other ranks, and finding the largest id
costs a pass over the ids at every call. So nothing is checked while calls succeed; when one
fails, its inputs are compared with what was captured (rank, dtype, sizes that were equal in the
example, ids against the rows of the tables they index, lengths against a position table) and a
fitting difference is raised as :class:`InputMismatchError` naming the input, from the error.
A failure no difference explains is raised as it was: a bug stays visible as one.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from qplug_core.errors import BackendError, InputMismatchError, QplugError, first_line, input_mismatch
from qplug_core.flows.kernel_faults import kernel_fault
from qplug_core.flows.table_lookups import TableLookup, table_lookups
from qplug_core.flows.tags import INPUT_SPEC, SPEC_DTYPES
from qplug_core.ir.call_inputs import input_paths
from qplug_core.ir.failed_calls import explain_failures

__all__ = ["explain_call_faults"]


def explain_call_faults(gm: fx.GraphModule) -> None:
    """Make a failing call of the converted model ``gm`` name the input at fault where one is, else
    the backend kernel that raised (``flows/kernel_faults.py``)."""
    explain_failures(gm, _call_fault)


def _call_fault(gm: fx.GraphModule, args: tuple, kwargs: dict, error: Exception) -> QplugError | None:
    return input_fault(gm, args, kwargs, error) or kernel_fault(gm, error)


def input_fault(gm: fx.GraphModule, args: tuple, kwargs: dict, error: Exception) -> InputMismatchError | None:
    """The error naming the input that made a call of ``gm`` with ``args``/``kwargs`` raise ``error``
    (None where the inputs are as captured, or the error is qplug's own refusal)."""
    if not _failed_running(error):
        return None
    given = dict(_given_inputs(gm, args, kwargs))
    why = (_wrong_ranks(given) or _out_of_table(gm, given)
           or (_unequal_sizes(given) if _about_sizes(error) else "") or _wrong_dtypes(given))
    if not why:
        return None
    return input_mismatch(f"{why} (the int8 model raised {type(error).__name__}: {first_line(error)[:300]})",
                          type(error))


#: words of torch's and the runtimes' messages about tensors whose sizes do not fit together
_SIZE_WORDS = ("size", "shape", "dimension", "broadcast", "must match", "mat1 and mat2")


def _about_sizes(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) speaks of sizes: two inputs whose sizes merely matched in the
    example do not explain a failure that says something else (a NaN check, a bug)."""
    text = f"{error} {error.__cause__ or ''}".lower()
    return any(word in text for word in _SIZE_WORDS)


def _failed_running(error: Exception) -> bool:
    """Whether ``error`` is a failure while the model ran: torch's or a runtime's own error, a
    delegated partition's (:class:`BackendError`), or a partition's refusal of its inputs raised
    from such an error; not one of qplug's checks of the inputs at the call."""
    if isinstance(error, BackendError) or not isinstance(error, QplugError):
        return True
    cause = error.__cause__
    return isinstance(error, InputMismatchError) and cause is not None and not isinstance(cause, QplugError)


#: an input as given and as captured: (its name in a call, the tensor, its captured INPUT_SPEC)
_Given = tuple[str, torch.Tensor, dict]


def _given_inputs(gm: fx.GraphModule, args: tuple, kwargs: dict) -> Iterator[tuple[str, _Given]]:
    """Per placeholder with a captured spec that the call gives a tensor: its name and what it is."""
    placeholders = [node for node in gm.graph.nodes if node.op == "placeholder"]
    for path, node in zip(input_paths(gm), placeholders):
        spec = node.meta.get(INPUT_SPEC)
        if path is None or spec is None:
            continue
        try:
            value = path.value(args, kwargs)
        except QplugError:
            continue
        if isinstance(value, torch.Tensor):
            yield str(node.target), (path.label, value, spec)


def _wrong_ranks(given: dict[str, _Given]) -> str:
    wrong = [f"input {label!r} has {value.dim()} dimension(s) {tuple(value.shape)} where the model was "
             f"captured with {len(spec['shape'])} (its example was {tuple(spec['shape'])})"
             for label, value, spec in given.values() if value.dim() != len(spec["shape"])]
    if not wrong:
        return ""
    return "; ".join(wrong) + (": call it with inputs of the example's rank (a single sequence as a batch "
                               "of one: x[None]), or quantize with an example of the rank you call it with")


def _out_of_table(gm: fx.GraphModule, given: dict[str, _Given]) -> str:
    for lookup in table_lookups(gm):
        if lookup.input not in given:
            continue
        label, value, _ = given[lookup.input]
        if lookup.dim is not None:
            if value.dim() > lookup.dim and value.shape[lookup.dim] > lookup.rows:
                return _too_long(lookup, _sharing(given, lookup.input, lookup.dim), value)
        elif not value.is_floating_point() and value.numel() and (
                value.min() < 0 or value.max() >= lookup.rows):
            return _not_in_table(lookup, label, value)
    return ""


def _not_in_table(lookup: TableLookup, label: str, value: torch.Tensor) -> str:
    low, high = int(value.min()), int(value.max())
    return (f"input {label!r} holds ids from {low} to {high}, but the table {lookup.table!r} it indexes has "
            f"{lookup.rows} rows (ids 0 to {lookup.rows - 1}): pass ids of the vocabulary the model was "
            "built with (the same tokenizer)")


def _sharing(given: dict[str, _Given], name: str, dim: int) -> list[str]:
    """The inputs whose size torch.export captured as one with ``name``'s at ``dim`` (the ids of a
    mask whose length the graph reads), that input first."""
    symbols = given[name][2].get("symbols") or []
    symbol = symbols[dim] if dim < len(symbols) else None
    shared = [label for other, (label, _, spec) in given.items()
              if other != name and symbol is not None and symbol in (spec.get("symbols") or [])]
    return [given[name][0], *shared]


def _too_long(lookup: TableLookup, labels: list[str], value: torch.Tensor) -> str:
    dim, rows = lookup.dim, lookup.rows
    inputs = " and ".join(f"{label!r}" for label in labels)
    return (f"input {inputs} {'has' if len(labels) == 1 else 'have'} length {value.shape[dim]} (at dim {dim}), "
            f"but the model's position table {lookup.table!r} has {rows} rows: it takes sequences of at most "
            f"{rows}. Truncate longer inputs to {rows} (or split them)")


def _unequal_sizes(given: dict[str, _Given]) -> str:
    """Two inputs that had equal sizes at a dimension in the example and differ now (an attention
    mask shorter than its ids)."""
    inputs = [(label, value, spec["shape"]) for label, value, spec in given.values()]
    for i, (label, value, shape) in enumerate(inputs):
        for other_label, other, other_shape in inputs[i + 1:]:
            for dim in range(min(len(shape), len(other_shape), value.dim(), other.dim())):
                if shape[dim] == other_shape[dim] and value.shape[dim] != other.shape[dim]:
                    return (f"input {label!r} has size {value.shape[dim]} at dim {dim} and input {other_label!r} "
                            f"{other.shape[dim]}, where their examples had equal sizes there ({tuple(shape)}, "
                            f"{tuple(other_shape)}): give them equal sizes (pad both to one length)")
    return ""


def _wrong_dtypes(given: dict[str, _Given]) -> str:
    wrong = [f"input {label!r} is {str(value.dtype).removeprefix('torch.')} where the model was captured with "
             f"{spec['dtype']}" for label, value, spec in given.values() if value.dtype is not SPEC_DTYPES[spec["dtype"]]]
    return "; ".join(wrong) + ": pass the dtypes of the example inputs" if wrong else ""

"""A converted model whose per-op kernel raises at run time names the layer, the plugin and the kernel.

A plugin's kernel passes convert on the example and calibration batches and may still raise later
(a batch beyond a runtime's buffer): the user met the runtime's bare exception, naming no layer
nor plugin, where a delegated partition's failure names both (``DelegateRuntimeError``). A wrapper
on every kernel would cost each call; nothing needs to run while calls succeed, so the model's own
call catches the error (``ir/failed_calls.py``) and its traceback says which kernel module was
running, as eager models name a failed layer (``eager/failed_layers.py``). The kernel's exception
is the cause of the :class:`KernelRuntimeError` raised instead.
"""

from __future__ import annotations

from torch import fx

from qplug_core.errors import KernelRuntimeError, QplugError, first_line
from qplug_core.flows.report import report_names
from qplug_core.flows.tags import KERNEL, REPORT
from qplug_core.ir.failed_calls import failed_module_calls
from qplug_core.registry import plugins
from qplug_core.registry.backends import get_backend

__all__ = ["kernel_fault"]


def kernel_fault(gm: fx.GraphModule, error: Exception) -> KernelRuntimeError | None:
    """The error naming the backend kernel of ``gm`` whose call raised ``error`` (None where none
    did, or where the error is qplug's own and already says what is wrong)."""
    if isinstance(error, QplugError):
        return None
    kernels = {id(gm.get_submodule(str(node.target))): node for node in gm.graph.nodes
               if node.op == "call_module" and isinstance(node.meta.get(KERNEL), str)
               and node.meta[KERNEL] != "passthrough" and not node.meta[KERNEL].startswith("delegate:")}
    node = next((kernels[id(called)] for called, _ in failed_module_calls(error) if id(called) in kernels),
                None)
    if node is None:
        return None
    op, layer, backend = node.meta[KERNEL], report_names(gm.graph)(node), gm.meta[REPORT].backend
    record = _kernel_plugin(backend, op)
    by = f" of plugin {record.label}" if record is not None else ""
    disable = f"; disable it with {plugins.ENV_DISABLE}={record.name}" if record is not None else ""
    return KernelRuntimeError(
        f"backend {backend!r}: kernel {op}{by} raised {type(error).__name__} in layer {layer!r}: "
        f"{first_line(error)[:300]}; qp.load(path, backend='reference') runs a saved model without "
        f"it{disable}", backend=backend, plugin=record.name if record else None,
        dist=record.dist if record else None, kernel=op, layer=layer)


def _kernel_plugin(backend_name: str, op: str) -> plugins.PluginRecord | None:
    """The plugin that contributed kernel ``op`` to the backend, if that backend assembles here."""
    try:
        backend = get_backend(backend_name)
    except QplugError:
        return None
    return next((backend.kernel_plugins[key] for key, spec in backend.kernels.items()
                 if spec.op == op and key in backend.kernel_plugins), None)

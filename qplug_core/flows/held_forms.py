"""A converted model's reference forms, held with int8 weights once it is lowered or delegated.

Besides the modules it runs, a converted model keeps reference forms: the snapshot ``qp.save``
writes (``flows/snapshot.py``), each compiled partition's own (serialized again for a new input
signature, run where a signature is refused) and, for ``qp.compare``, each partition as fused
into the model (``PARTITION_FORMS``). Their weights lie on the int8 grid and the model no longer
runs them: held in float they kept a delegated model at ~2.3x its float model's bytes. Each float
weight gets one int8 copy, shared by every form holding it (a quarter of the bytes); what the
model still runs itself stays float. Where a runtime keeps the int8 weights it compiled as they
are (OpenVINO), the held forms read those instead of keeping their own copy.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qplug_core.flows.snapshot import hold_weights_as_int8
from qplug_core.flows.tags import PARTITION_FORMS
from qplug_core.kernels.held_int8 import Copies, Int8HeldForm, int8_form
from qplug_core.kernels.reference import weight_of
from qplug_core.partition.compiled import CompiledPartition
from qplug_core.partition.held import HoldsPartition


def hold_reference_forms_as_int8(gm: fx.GraphModule, copies: Copies) -> None:
    """Hold ``gm``'s snapshot, its partitions' reference forms and ``PARTITION_FORMS`` with int8
    weights (call it once ``gm`` is lowered; ``copies``: those lowering made already)."""
    hold_weights_as_int8(gm, copies)
    running = {id(module) for module in gm.modules()}
    for module in gm.modules():
        if isinstance(module, HoldsPartition) and isinstance(module.form, fx.GraphModule):
            module.hold(int8_form(module.form, copies, running))
            if isinstance(module, CompiledPartition):
                read_from_runtime(module.form, module.runtime_int8())
    forms = gm.meta.get(PARTITION_FORMS)
    if forms:
        gm.meta[PARTITION_FORMS] = {name: int8_form(form, copies, running) if isinstance(form, fx.GraphModule)
                                    else form for name, form in forms.items()}


def read_from_runtime(form: Int8HeldForm, tensors: list[torch.Tensor]) -> None:
    """Swap each int8 weight of ``form`` equal to one of ``tensors`` (a runtime's copy of it,
    :meth:`CompiledPartition.runtime_int8`) for that tensor, in the module every form holding it
    shares: OpenVINO keeps the int8 weights it compiled, and the held forms kept another copy."""
    by_shape: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_shape.setdefault((tuple(tensor.shape), tensor.dtype), []).append(tensor)
    for path in form.int8_weights:
        module = form.held.get_submodule(path)
        values = weight_of(module.module, module.weight_name)
        for tensor in by_shape.get((tuple(values.shape), values.dtype), ()):
            if tensor.data_ptr() == values.data_ptr() or torch.equal(tensor, values):
                owner_path, _, name = module.weight_name.rpartition(".")
                owner = module.module.get_submodule(owner_path) if owner_path else module.module
                setattr(owner, name, nn.Parameter(tensor, requires_grad=False))
                break


def reference_form(form: fx.GraphModule | Int8HeldForm) -> fx.GraphModule:
    """A partition form from ``PARTITION_FORMS`` as a GraphModule."""
    return form if isinstance(form, fx.GraphModule) else form.graph_module

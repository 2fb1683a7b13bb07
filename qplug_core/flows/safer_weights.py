"""A delegated partition that broke the contract where its kernels sum pairs in int16: 7-bit weights.

Without VNNI, a compiler on FBGEMM-, oneDNN- or MLAS-style U8S8 kernels sums two adjacent
u8 x s8 products in int16 with saturation. A partition whose layers have 8-bit weights (a user's
qconfig, or a layer ``flows/weight_bits.py`` found safe on the data it saw) can then break the
contract at convert. Before such a partition is given up (kept in the slow reference form), its
layers' weights are re-derived on the safe range (7 bits: two products of 255 and 64 fit int16,
``kernels/arithmetic.py``) and it is compiled and checked again (``flows/delegate.py``).

The change is made in place on the partition's reference modules, which the kept reference form
shares (``flows/snapshot.py``): what ``qp.save`` writes and ``qp.load`` compiles is then the
7-bit form that passed. Where the second check fails too, :meth:`SaferWeights.undo` restores the
8-bit modules. The weights are re-rounded from their 8-bit values (the float ones are not kept
after convert): a weight is then within 0.75 of a 7-bit step of its float value (half an 8-bit
step, then half a 7-bit one), not 0.5 as a 7-bit convert would give.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from qplug_core.kernels.arithmetic import pair_sums_saturate, safe_weight_range
from qplug_core.kernels.reference import ReferenceWeighted, weight_of
from qplug_core.qparams import compute_qparams

#: the activation codes the safe weight range is derived for (u8, full range)
_ACTIVATION_MAX = 255


@dataclass
class SaferWeights:
    """The layers of one partition given safe weights, and how to give them back."""

    layers: list[str]
    _undo: list[tuple[ReferenceWeighted, nn.Module, nn.Module]] = field(default_factory=list, repr=False)

    def undo(self) -> None:
        for module, wrapped, holder in self._undo:
            module.module, module.weight_qparams_holder = wrapped, holder


def make_safer(partition: fx.GraphModule, arithmetic: Any) -> SaferWeights | None:
    """Give every symmetric int8-weighted layer of ``partition`` whose weight range is wider than
    the safe one the safe range, in place; None where nothing changes (``arithmetic`` cannot
    saturate on this CPU, or the weights are already safe)."""
    if arithmetic is None or not pair_sums_saturate(arithmetic):
        return None
    safer = SaferWeights([])
    for name, module, safe in _wide_layers(partition):
        old = module.weight_qparams
        weight = weight_of(module.module, module.weight_name).detach()
        if old.per_channel:
            amax = weight.abs().amax(dim=[d for d in range(weight.dim()) if d != old.axis])
            scheme = torch.per_channel_symmetric
        else:
            amax, scheme = weight.abs().max(), torch.per_tensor_symmetric
        scale, zero_point = compute_qparams(-amax, amax, dtype=torch.qint8, qscheme=scheme,
                                            quant_min=safe[0], quant_max=safe[1])
        qparams = dataclasses.replace(old, scale=scale, zero_point=zero_point, quant_min=safe[0],
                                      quant_max=safe[1])
        fresh = ReferenceWeighted(module.module, qparams, module.weight_name)
        safer._undo.append((module, module.module, module.weight_qparams_holder))
        module.module, module.weight_qparams_holder = fresh.module, fresh.weight_qparams_holder
        safer.layers.append(name)
    return safer if safer.layers else None


def may_saturate(partition: fx.GraphModule, arithmetic: Any) -> bool:
    """Whether ``partition``'s kernels can saturate int16 pair sums on this CPU: ``arithmetic``
    sums pairs in int16 here and a layer has symmetric int8 weights wider than the safe range
    (a file converted on a CPU with VNNI, loaded on one without, is the common case)."""
    if arithmetic is None or not pair_sums_saturate(arithmetic):
        return False
    return next(_wide_layers(partition), None) is not None


def _wide_layers(partition: fx.GraphModule) -> Iterator[tuple[str, ReferenceWeighted, tuple[int, int]]]:
    """(name, module, safe range) of each symmetric int8-weighted layer wider than the safe range."""
    for name, module in partition.named_modules():
        if not isinstance(module, ReferenceWeighted):
            continue
        old = module.weight_qparams
        safe = safe_weight_range((old.quant_min, old.quant_max), _ACTIVATION_MAX)
        if old.dtype == torch.qint8 and not bool(old.zero_point.ne(0).any()) and safe != (old.quant_min, old.quant_max):
            yield name, module, safe


__all__ = ["SaferWeights", "make_safer", "may_saturate"]

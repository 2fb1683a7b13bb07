"""Per layer on CPUs without VNNI: 8-bit weights where no int16 pair sum saturates, else 7 bits.

A backend's default qconfig gives 7-bit weights on such CPUs (``kernels/arithmetic.py``): with
full 8-bit operands two adjacent u8 x s8 products can leave int16. That costs every layer one
bit (ResNet-18: 28.3 -> 25.3 dB), while most layers never come near: a pair saturates only where
large codes meet large weights of one sign side by side. So when the backend's own defaults were
used (a user's qconfig is the user's; a mapping qplug resolved from the defaults on the user's
behalf, as ``qp.quantize`` with a recipe or a target does, is marked by :func:`backend_defaults`
and counts as the defaults, with its copies), convert asks per weighted layer, on the example inputs
recorded at prepare and the few calibration batches kept (``flows/calibration_sample.py``: at most
``MAX_BATCHES``, evenly spread, each run once more through the observed graph; of all runs
together at most ``MAX_ROWS`` GEMM rows per layer are emulated): with the 8-bit weights the backend would use with VNNI, does any pair sum of
this layer's real operands leave int16 (``kernels/pair_sums.py``, in the kernels' K order)? If
none does, the layer gets 8-bit weights; if some do, it gets them only where its output error
(rounding plus what saturation takes) is below the 7-bit weights' on the same rows. The decisions
(layer -> why) are kept in ``GraphModule.meta[WEIGHT_BITS_CHOICE]``. A backend whose runtime lays
out operands itself (``pairs_in_torch_order=False``: OpenVINO) pairs other products than the
emulation, so its layers all keep the 7-bit weights.

7-bit activations and S8S8 are not per-layer choices here: an activation's grid is shared by
every consumer of the value (not one layer's to change), and FBGEMM takes u8 activations only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from qplug_core.config import QConfigMapping
from qplug_core.flows import calibration_sample
from qplug_core.flows.observed import observed_inputs
from qplug_core.flows.tags import EXAMPLE_INPUTS, OBSERVER, ROOT, WEIGHT_BITS, WEIGHT_BITS_CHOICE, region_tag
from qplug_core.kernels import pair_sums
from qplug_core.kernels.arithmetic import pair_sums_saturate
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.reference import ReferenceWeighted
from qplug_core.qparams import QParams

#: flags of a CPU whose int8 products accumulate in int32 (to ask a backend its 8-bit defaults)
_INT32_CPU = "avx2 avx512f avx512bw avx512_vnni"
#: the pair sums of at most this many GEMM rows per layer are computed (over all runs), evenly
#: spread (the bound on which pairs can saturate at all sees every row of every run)
MAX_ROWS = 1024


#: set on a mapping :func:`backend_defaults` resolved (``copy.deepcopy`` keeps it)
_RESOLVED = "_qplug_backend_defaults"


def backend_defaults(backend: Any, mode: str = "static") -> QConfigMapping:
    """``backend``'s default mapping for ``mode``, resolved on the user's behalf: a flow that must
    pass a mapping to prepare explicitly (a recipe needs it first) passes this one, and it and
    its copies (a target's fallbacks) still get the per-layer choice."""
    mapping = backend.default_qconfig_mapping(mode)
    setattr(mapping, _RESOLVED, True)
    return mapping


def users_own(mapping: QConfigMapping | None) -> bool:
    """Whether ``mapping`` (given to prepare) is the user's: not None, not :func:`backend_defaults`'s."""
    return mapping is not None and not getattr(mapping, _RESOLVED, False)


def converted_weight_ranges(reference: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """module name -> the integer range of its weights in a converted model's reference form."""
    return {name: (m.weight_qparams.quant_min, m.weight_qparams.quant_max)
            for name, m in reference.named_modules() if isinstance(m, ReferenceWeighted)}


def mark(gm: fx.GraphModule, backend: Any, mode: str, user_mapping: bool) -> None:
    """At prepare: let convert choose weight bits per layer if ``backend``'s defaults are in use
    and they are 7-bit here only because of int16 pair sums (keeps the 8-bit weight range), and
    its kernels pair products as the emulation does (``backend.pairs_in_torch_order``)."""
    if (user_mapping or mode != "static" or not backend.pairs_in_torch_order
            or not pair_sums_saturate(backend.arithmetic)):
        return
    with override_cpu_flags(_INT32_CPU):
        mapping = backend.default_qconfig_mapping(mode)
    qconfig = mapping.global_qconfig if mapping is not None else None
    if qconfig is None or qconfig.weight is None:
        return
    observer = qconfig.weight()
    if observer.dtype == torch.qint8:
        gm.meta[WEIGHT_BITS] = (int(observer.quant_min), int(observer.quant_max))


#: one run's operands of a layer: sampled GEMM rows of codes, each K column's highest and lowest code
_Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class _Inputs(fx.Interpreter):
    """Runs an observed graph with its observers passed through (they must not learn from these
    runs), keeping what ``wanted[node]`` makes of each wanted node's input on each run (the
    layer's operands: a bounded sample, not the whole activation, so memory does not grow with
    the number of runs)."""

    def __init__(self, gm: fx.GraphModule, wanted: dict[fx.Node, Callable[[Any], _Operands | None]]):
        super().__init__(gm)
        self.wanted = wanted
        self.inputs: dict[fx.Node, list[_Operands | None]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "call_module" and OBSERVER in n.meta:
            return self.env[n.args[0]] if isinstance(n.args[0], fx.Node) else n.args[0]
        if n in self.wanted:
            self.inputs.setdefault(n, []).append(self.wanted[n](self.env[n.args[0]]))
        return super().run_node(n)


class WeightBits:
    """The convert-time choice for one observed model (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.full: tuple[int, int] | None = gm.meta.get(WEIGHT_BITS)
        self.choices: dict[str, str] = gm.meta.setdefault(WEIGHT_BITS_CHOICE, {}) if self.full else {}
        self.inputs: dict[fx.Node, list[_Operands | None]] = {}
        self.zero_points: dict[fx.Node, int] = {}
        self.data = "the example inputs"
        example = gm.meta.get(EXAMPLE_INPUTS)
        batches = calibration_sample.take(gm)
        if self.full is None or example is None:
            self.full = None
            return
        rows = max(1, MAX_ROWS // (1 + len(batches)))  # per run: MAX_ROWS over all runs
        wanted = {n: reduce for n in gm.graph.nodes if n.meta.get(ROOT) and n.op == "call_module"
                  and (tag := region_tag(n)) is not None and tag.quantized and n.args
                  and isinstance(n.args[0], fx.Node) and (reduce := self._operands(n, rows)) is not None}
        recorder = _Inputs(gm, wanted)
        try:
            with torch.no_grad():
                for batch in (example, *batches):
                    recorder.run(*batch)
        except Exception:  # the data no longer fits the graph: the safe 7-bit weights stay
            self.full = None
            return
        self.inputs = recorder.inputs
        if batches:
            self.data += f" and {len(batches)} calibration batch(es)"

    def weight_qparams(self, node: fx.Node, module: nn.Module, qconfig: Any, weight: torch.Tensor,
                       safe: QParams) -> QParams:
        """``safe`` (the qconfig's 7-bit weights), or 8-bit ones where no pair sum saturates."""
        if self.full is None or node not in self.inputs or safe.dtype != torch.qint8:
            return safe
        if (safe.quant_min, safe.quant_max) == self.full:
            return safe
        layer = next((m for m in module.modules() if pair_sums.supported(m)), None)
        runs = [r for r in self.inputs[node] if r is not None]
        if layer is None or len(runs) < len(self.inputs[node]):  # an input that is not a float tensor
            return safe
        observer = qconfig.weight(quant_min=self.full[0], quant_max=self.full[1])
        observer(weight.detach())
        wide = observer.qparams()
        loss = _Losses(layer, runs, self.zero_points[node], weight)
        sums, wide_error = loss.of(wide, saturating=True)
        if not sums.saturated:
            self.choices[node.name] = f"8-bit weights: no int16 pair sum saturates on {self.data}"
            return wide
        _, safe_error = loss.of(safe, saturating=False)
        keep = wide_error <= safe_error
        self.choices[node.name] = (
            f"{8 if keep else 7}-bit weights: {sums.saturated} int16 pair sum(s) of "
            f"{loss.codes.shape[1]} rows saturate with 8-bit weights on {self.data}; output "
            f"error {wide_error / safe_error if safe_error else float('inf'):.2f}x that of 7-bit weights")
        return wide if keep else safe

    def _operands(self, node: fx.Node, rows: int) -> Callable[[Any], _Operands | None] | None:
        """What to keep of ``node``'s input on each run (its operands on the calibrated grid, at
        most ``rows`` GEMM rows), or None where the layer is not one to choose for."""
        observed = observed_inputs(self.gm, node)
        layer = next((m for m in self.gm.get_submodule(str(node.target)).modules()
                      if pair_sums.supported(m)), None)
        if not observed or layer is None:
            return None
        observer = observed[0].observer
        # a dynamic layer (a target's fallback) picks its input grid per batch: not chosen here
        if getattr(observer, "dtype", None) != torch.quint8 or getattr(observer, "is_dynamic", False):
            return None
        if not getattr(observer, "has_data", True):  # a branch calibration never ran stays float
            return None
        scale, zero_point = (t.flatten() for t in observer.calculate_qparams())
        if scale.numel() != 1:
            return None
        self.zero_points[node] = int(zero_point)

        def reduce(value: Any) -> _Operands | None:
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                return None
            codes = torch.clamp(torch.round(value.detach().float() / scale) + zero_point,
                                observer.quant_min, observer.quant_max)
            return pair_sums.operands(layer, codes, int(zero_point), rows)
        return reduce


class _Losses:
    """One layer's output error on its recorded operands under candidate weight qparams (squared,
    summed; in units of activation codes times weights): rounding, plus what saturated int16
    pair sums take away where ``saturating``. The rows are those sampled on every run; the code
    range of each K column is that over every row of every run."""

    def __init__(self, layer: nn.Module, runs: list[_Operands], zero_point: int, weight: torch.Tensor):
        self.layer, self.weight = layer, weight.detach()
        self.codes = torch.cat([rows for rows, _, _ in runs], dim=1)
        self.high = torch.stack([high for _, high, _ in runs]).amax(0)
        self.low = torch.stack([low for _, _, low in runs]).amin(0)
        self.shifted = self.codes - zero_point
        self.exact = pair_sums.weight_operands(layer, self.weight)

    def of(self, qparams: QParams, *, saturating: bool) -> tuple[pair_sums.PairSums | None, float]:
        scale = qparams.scale.reshape(-1, *([1] * (self.weight.dim() - 1)))
        integers = torch.clamp(torch.round(self.weight / scale), qparams.quant_min, qparams.quant_max)
        w = pair_sums.weight_operands(self.layer, integers)
        channel_scale = pair_sums.weight_operands(self.layer, scale.expand_as(self.weight))[..., 0]
        error = torch.einsum("gmk,gnk->gmn", self.shifted, w * channel_scale[..., None] - self.exact)
        sums = pair_sums.pair_sums(self.codes, w, self.high, self.low) if saturating else None
        if sums is not None:
            error = error - sums.shortfall.float() * channel_scale[:, None, :]
        return sums, float((error.double() ** 2).sum())


__all__ = ["MAX_ROWS", "WeightBits", "backend_defaults", "converted_weight_ranges", "mark", "users_own"]

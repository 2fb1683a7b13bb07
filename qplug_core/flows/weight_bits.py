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
none does, the layer gets 8-bit weights; if some do, 8-bit weights only where saturation changes
at most ``MAX_SATURATED_SHARE`` of its outputs and its output error (rounding plus what saturation
takes) is below the 7-bit weights', else 7-bit weights, or 8-bit weights on 7-bit activations
where those lose less (below). Saturation is not in the reference form, the model every backend
is checked against: where it changes more outputs, the kernels leave it (on the digits CNN,
FBGEMM's and ONNX Runtime's real AVX2 kernels put 7% of the outputs more than a step from it). The decisions
(layer -> why) are kept in ``GraphModule.meta[WEIGHT_BITS_CHOICE]``, and with their qparams in
``meta[WEIGHT_BITS_DECIDED]``: a target search converts the same calibrated layers several times
with some of them taken out, and its tries take the first convert's decisions
(``meta[WEIGHT_BITS_REUSE]``) instead of running the example and calibration batches through
the graph again for each (on MiniLM, a third of each try's convert). A backend whose runtime lays
out operands itself (``pairs_in_torch_order=False``: OpenVINO) pairs other products than the
emulation, so its layers all keep the 7-bit weights.

7-bit activations and S8S8 are not per-layer choices here: an activation's grid is shared by
every consumer of the value (not one layer's to change), and FBGEMM takes u8 activations only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from qplug_core.config import QConfigMapping
from qplug_core.errors import first_line
from qplug_core.flows import calibration_sample
from qplug_core.flows.observed import ObservedValue, observed_inputs, observed_values
from qplug_core.flows.tags import (
    BACKEND_DEFAULTS,
    CONVERSION_NOTES,
    EXAMPLE_INPUTS,
    FOLDED_CLAMP,
    OBSERVER,
    ROOT,
    WEIGHT_BITS,
    WEIGHT_BITS_CHOICE,
    WEIGHT_BITS_DECIDED,
    WEIGHT_BITS_REUSE,
    region_tag,
)
from qplug_core.kernels import pair_sums
from qplug_core.kernels.arithmetic import pair_sums_saturate
from qplug_core.kernels.cpu import override_cpu_flags
from qplug_core.kernels.reference import ReferenceWeighted, observed_weight_qparams
from qplug_core.qparams import QParams

#: flags of a CPU whose int8 products accumulate in int32 (to ask a backend its 8-bit defaults)
_INT32_CPU = "avx2 avx512f avx512bw avx512_vnni"
#: the pair sums of at most this many GEMM rows per layer are computed (over all runs), evenly
#: spread (the bound on which pairs can saturate at all sees every row of every run)
MAX_ROWS = 1024
#: 8-bit weights whose pair sums saturate stay where they lose less than 7 bits and saturation
#: changes at most this share of the layer's outputs: ResNet-18's layers but its first change
#: 0.01-0.08% (8 bits: 27.7 dB on FBGEMM's AVX2 kernels against 26.0 without them), the digits
#: CNN's 0.64% (its outputs then left the reference form by more than a step in 7% of cases)
MAX_SATURATED_SHARE = 1e-3




def backend_defaults(backend: Any, mode: str = "static") -> QConfigMapping:
    """``backend``'s default mapping for ``mode``, resolved on the user's behalf: a flow that must
    pass a mapping to prepare explicitly (a recipe needs it first) passes this one, and it and
    its copies (a target's fallbacks) still get the per-layer choice."""
    mapping = backend.default_qconfig_mapping(mode)
    setattr(mapping, BACKEND_DEFAULTS, True)
    return mapping


def users_own(mapping: QConfigMapping | None) -> bool:
    """Whether ``mapping`` (given to prepare) is the user's: not None, not :func:`backend_defaults`'s."""
    return mapping is not None and not getattr(mapping, BACKEND_DEFAULTS, False)


def converted_weight_ranges(reference: fx.GraphModule) -> dict[str, tuple[int, int]]:
    """module name -> the integer range of its weights in a converted model's reference form (or a
    snapshot's ``held`` form, the same qparams without rebuilding its float weights)."""
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


#: one run's operands of a layer: sampled GEMM rows of codes, each K column's highest and lowest
#: code, and the same rows in float
_Operands = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Decided:
    """One layer's decision: its weight qparams, why (None: the safe weights, nothing weighed),
    and whether its input's grid was made 7-bit."""

    qparams: QParams
    why: str | None
    seven_bit_input: bool


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
        self.grids: dict[fx.Node, tuple[float, int]] = {}  # each layer's input grid (scale, zero point)
        self.decided: dict[fx.Node, QParams] = {}
        self.seven_bit_inputs: set[fx.Node] = set()
        self.record: dict[str, Decided] = gm.meta.setdefault(WEIGHT_BITS_DECIDED, {}) if self.full else {}
        self.reused: dict[str, Decided] | None = gm.meta.pop(WEIGHT_BITS_REUSE, None)
        self._observer_uses: Counter[int] = Counter()
        self.data = "the example inputs"
        example = gm.meta.get(EXAMPLE_INPUTS)
        batches = calibration_sample.take(gm)
        if self.full is None or example is None:
            self.full = None
            return
        if self.reused is not None:
            return  # nothing to record: the decisions are taken as they are
        rows = max(1, MAX_ROWS // (1 + len(batches)))  # per run: MAX_ROWS over all runs
        wanted = {n: reduce for n in gm.graph.nodes if n.meta.get(ROOT) and n.op == "call_module"
                  and (tag := region_tag(n)) is not None and tag.quantized and n.args
                  and isinstance(n.args[0], fx.Node) and (reduce := self._operands(n, rows)) is not None}
        recorder = _Inputs(gm, wanted)
        if batches:
            self.data += f" and {len(batches)} calibration batch(es)"
        try:
            with torch.no_grad():
                for batch in (example, *batches):
                    recorder.run(*batch)
        except Exception as error:  # noqa: BLE001 - the data no longer fits the graph: the safe 7-bit weights stay
            self.full = None
            gm.meta.setdefault(CONVERSION_NOTES, []).append(
                f"8-bit weight search not run: {self.data} no longer ran through the graph "
                f"({type(error).__name__}: {first_line(error)}), so every layer keeps this CPU's safe 7-bit weights")
            return
        self.inputs = recorder.inputs
        self._observer_uses.update(id(v.observer) for v in observed_values(gm))

    def weight_qparams(self, node: fx.Node, module: nn.Module, qconfig: Any, weight: torch.Tensor,
                       safe: QParams) -> QParams:
        """``safe`` (the qconfig's 7-bit weights), or 8-bit ones where no pair sum saturates or
        where saturation changes few outputs and they lose less, or 8-bit ones on 7-bit activations
        where those lose less for the input's every consumer (then the input's grid is made 7-bit
        here)."""
        if self.full is None or safe.dtype != torch.qint8 or (safe.quant_min, safe.quant_max) == self.full:
            return safe
        if self.reused is not None:
            return self._reuse(node, safe)
        if node not in self.inputs:
            return safe
        if node not in self.decided:
            self._decide(node, module, qconfig, weight, safe)
        qparams = self.decided.get(node, safe)
        self.record[node.name] = Decided(qparams, self.choices.get(node.name), node in self.seven_bit_inputs)
        return qparams

    def _reuse(self, node: fx.Node, safe: QParams) -> QParams:
        """The earlier convert's decision for ``node`` (``safe`` where it made none, or where
        ``node`` no longer reads a static input here: a dynamic layer picks its own grid)."""
        earlier = self.reused.get(node.name) if self.reused is not None else None
        observer = self._static_input_observer(node)
        if earlier is None or observer is None:
            return safe
        if earlier.seven_bit_input:
            observer.quant_max = 127
        if earlier.why is not None:
            self.choices[node.name] = earlier.why
        return earlier.qparams

    def _decide(self, node: fx.Node, module: nn.Module, qconfig: Any, weight: torch.Tensor,
                safe: QParams) -> None:
        """The weights of ``node``, and of every other consumer of its input where 7-bit
        activations (a grid they share) are to be weighed against their weight choices."""
        options = self._options(node, module, qconfig, weight, safe)
        if options is None:
            return
        shared = self._shared_input(node)
        users = [] if shared is None else [n for n in shared.node.users if n is not node]
        options_by_node = {node: options}
        for user in users:
            if (found := self._options_of(user)) is None:
                break
            options_by_node[user] = found
        if shared is None or len(options_by_node) < 1 + len(users):  # only this layer's weights
            self._choose(node, options)
            return
        if not any(o.saturated for o in options_by_node.values()):
            for n, o in options_by_node.items():
                self._choose(n, o)
            return
        by_weights = sum(o.best()[1] for o in options_by_node.values())
        seven = self._seven_bit_grid(shared.observer)
        by_activations = sum(o.seven_bit_activations(seven) for o in options_by_node.values())
        if by_activations >= by_weights:
            for n, o in options_by_node.items():
                self._choose(n, o, activations_error=by_activations / by_weights if by_weights else None)
            return
        shared.observer.quant_max = 127  # the input's grid, shared by every consumer: 7 bits
        for n, o in options_by_node.items():
            self.decided[n] = o.wide
            self.seven_bit_inputs.add(n)
            self.choices[n.name] = (
                f"8-bit weights on 7-bit activations: the input of {len(options_by_node)} layer(s) "
                f"given 7 bits (pairs then fit int16); their output error "
                f"{by_activations / by_weights:.2f}x that of the best weight bits on {self.data}")

    def _choose(self, node: fx.Node, options: _Options, activations_error: float | None = None) -> None:
        qparams, _ = options.best()
        self.decided[node] = qparams
        if not options.saturated:
            self.choices[node.name] = f"8-bit weights: no int16 pair sum saturates on {self.data}"
            return
        ratio = options.wide_error / options.safe_error if options.safe_error else float("inf")
        self.choices[node.name] = (
            f"{8 if qparams is options.wide else 7}-bit weights: {options.saturated} int16 pair sum(s) of "
            f"{options.loss.codes.shape[1]} rows saturate with 8-bit weights on {self.data}, changing "
            f"{100 * options.saturated_share:.2f}% of the outputs; output error {ratio:.2f}x that of 7-bit weights"
            + ("" if activations_error is None else
               f"; 7-bit activations (the input's grid) {activations_error:.2f}x the chosen error"))

    def _options(self, node: fx.Node, module: nn.Module, qconfig: Any, weight: torch.Tensor,
                 safe: QParams) -> _Options | None:
        """``node``'s layer under 8-bit and ``safe`` weights (None: not one to choose for)."""
        assert self.full is not None
        layer = next((m for m in module.modules() if pair_sums.supported(m)), None)
        runs = [r for r in self.inputs[node] if r is not None]
        if layer is None or len(runs) < len(self.inputs[node]):  # an input that is not a float tensor
            return None
        observer = qconfig.weight(quant_min=self.full[0], quant_max=self.full[1])
        observer(weight.detach())
        return _Options(_Losses(layer, runs, self.grids[node], weight), observer.qparams(), safe)

    def _options_of(self, node: fx.Node) -> _Options | None:
        """:meth:`_options` of another consumer, with the qparams convert would give it."""
        tag = region_tag(node)
        module = self.gm.get_submodule(str(node.target))
        layer = next((m for m in module.modules() if pair_sums.supported(m)), None)
        if node not in self.inputs or tag is None or layer is None or hasattr(module, "weight_fake_quant"):
            return None
        safe = observed_weight_qparams(tag.qconfig, layer.weight)
        if safe is None or safe.dtype != torch.qint8 or (safe.quant_min, safe.quant_max) == self.full:
            return None
        return self._options(node, module, tag.qconfig, layer.weight, safe)

    def _shared_input(self, node: fx.Node) -> ObservedValue | None:
        """``node``'s observed input if 7-bit activations are an option for it: an 8-bit grid of
        its own (not shared with another value), consumed by layers this choice covers only, and
        not a clamp that convert folds into its producer's output range (a 7-bit grid is too
        coarse to realise the clamp by saturation: the clamp would stay, and ONNX Runtime does
        not fuse a conv with a Clip between its Q/DQ)."""
        observed = observed_inputs(self.gm, node)
        if len(observed) != 1:
            return None
        value, observer = observed[0], observed[0].observer
        if (observer.quant_min, observer.quant_max) != (0, 255) or self._observer_uses[id(observer)] != 1:
            return None
        if FOLDED_CLAMP in value.value.meta:
            return None
        users = list(value.node.users)
        if not all(u in self.inputs and u.meta.get(ROOT) for u in users):
            return None
        return value

    def _static_input_observer(self, node: fx.Node) -> nn.Module | None:
        """The calibrated uint8 observer of ``node``'s input, or None: a dynamic layer (a
        target's fallback) picks its input grid per batch, and a branch calibration never ran
        stays float."""
        observed = observed_inputs(self.gm, node)
        observer = observed[0].observer if observed else None
        if observer is None or getattr(observer, "dtype", None) != torch.quint8 \
                or getattr(observer, "is_dynamic", False) or not getattr(observer, "has_data", True):
            return None
        return observer

    @staticmethod
    def _seven_bit_grid(observer: nn.Module) -> tuple[float, int]:
        """(scale, zero point) ``observer`` gives its data on codes 0..127."""
        observer.quant_max = 127
        try:
            scale, zero_point = (t.flatten() for t in observer.calculate_qparams())
        finally:
            observer.quant_max = 255
        return float(scale), int(zero_point)

    def _operands(self, node: fx.Node, rows: int) -> Callable[[Any], _Operands | None] | None:
        """What to keep of ``node``'s input on each run (its operands on the calibrated grid, at
        most ``rows`` GEMM rows), or None where the layer is not one to choose for."""
        layer = next((m for m in self.gm.get_submodule(str(node.target)).modules()
                      if pair_sums.supported(m)), None)
        observer = self._static_input_observer(node)
        if observer is None or layer is None:
            return None
        scale, zero_point = (t.flatten() for t in observer.calculate_qparams())
        if scale.numel() != 1:
            return None
        self.grids[node] = (float(scale), int(zero_point))

        def reduce(value: Any) -> _Operands | None:
            if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
                return None
            value = value.detach().float()
            codes = torch.clamp(torch.round(value / scale) + zero_point, observer.quant_min,
                                observer.quant_max)
            found, high, low = pair_sums.operands(layer, codes, int(zero_point), rows)
            return found, high, low, pair_sums.operands(layer, value, 0, rows)[0]
        return reduce


class _Losses:
    """One layer's output error on its recorded operands (squared, summed, against the float
    layer on the same float inputs): activation and weight rounding, plus what saturated int16
    pair sums take away where ``saturating``. The rows are those sampled on every run; the code
    range of each K column is that over every row of every run."""

    def __init__(self, layer: nn.Module, runs: list[_Operands], grid: tuple[float, int], weight: torch.Tensor):
        self.layer, self.weight, self.grid = layer, weight.detach(), grid
        self.codes = torch.cat([run[0] for run in runs], dim=1)
        self.high = torch.stack([run[1] for run in runs]).amax(0)
        self.low = torch.stack([run[2] for run in runs]).amin(0)
        self.floats = torch.cat([run[3] for run in runs], dim=1)
        self.exact = torch.einsum("gmk,gnk->gmn", self.floats, pair_sums.weight_operands(layer, self.weight))

    def of(self, qparams: QParams, *, saturating: bool, activations: tuple[float, int] | None = None
           ) -> tuple[pair_sums.PairSums | None, float]:
        """With the weights ``qparams`` give; the activations on the recorded 8-bit grid, or on
        ``activations`` (scale, zero point) with codes 0..127 (no pair sum can saturate)."""
        scale = qparams.scale.reshape(-1, *([1] * (self.weight.dim() - 1)))
        integers = torch.clamp(torch.round(self.weight / scale), qparams.quant_min, qparams.quant_max)
        w = pair_sums.weight_operands(self.layer, integers)
        channel_scale = pair_sums.weight_operands(self.layer, scale.expand_as(self.weight))[..., 0]
        if activations is None:
            (a_scale, zero_point), codes = self.grid, self.codes
        else:
            a_scale, zero_point = activations
            codes = torch.clamp(torch.round(self.floats / a_scale) + zero_point, 0, 127)
        out = torch.einsum("gmk,gnk->gmn", (codes - zero_point) * a_scale, w * channel_scale[..., None])
        sums = pair_sums.pair_sums(self.codes, w, self.high, self.low) if saturating else None
        if sums is not None:
            out = out - sums.shortfall.float() * a_scale * channel_scale[:, None, :]
        return sums, float(((out - self.exact).double() ** 2).sum())


class _Options:
    """One layer's candidate weights and their errors (:class:`_Losses`)."""

    def __init__(self, loss: _Losses, wide: QParams, safe: QParams):
        self.loss, self.wide, self.safe = loss, wide, safe
        sums, self.wide_error = loss.of(wide, saturating=True)
        assert sums is not None
        self.saturated = sums.saturated
        #: the share of the layer's outputs (sampled rows x channels) that saturation changes
        self.saturated_share = float((sums.shortfall != 0).float().mean())
        self.safe_error = loss.of(safe, saturating=False)[1] if self.saturated else float("inf")

    def best(self) -> tuple[QParams, float]:
        """8-bit weights where no pair saturates, or where saturation changes at most
        :data:`MAX_SATURATED_SHARE` of the layer's outputs and they lose less; else the safe ones."""
        if not self.saturated or (self.saturated_share <= MAX_SATURATED_SHARE and self.wide_error < self.safe_error):
            return self.wide, self.wide_error
        return self.safe, self.safe_error

    def seven_bit_activations(self, grid: tuple[float, int]) -> float:
        """The error of 8-bit weights on 7-bit activations (``grid``: their scale, zero point)."""
        return self.loss.of(self.wide, saturating=False, activations=grid)[1]


__all__ = ["MAX_ROWS", "MAX_SATURATED_SHARE", "WeightBits", "backend_defaults", "converted_weight_ranges", "mark", "users_own"]

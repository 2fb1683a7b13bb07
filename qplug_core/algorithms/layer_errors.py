"""Every weighted layer's int8 error, for every fallback, from ONE calibrated graph in one pass.

Ranking layers by quantizing the model once per layer costs a full quantization each (NNCF's
accuracy control spent 20 minutes ranking, nncf#3118). Here the float model runs once over the
evaluation batches; a forward hook on each weighted layer takes the float input ``x`` and output
``y`` it sees and recomputes the layer in each way it could run:

* ``static``: input, weights and output on the calibrated grids (the observers of the observed
  model, calibrated once), i.e. what static int8 does to this layer alone;
* ``per_token`` / ``dynamic``: the fallbacks of :mod:`.fallbacks`, simulated with their own
  arithmetic (per-token activation grids, or one grid per batch on the backend's dynamic range);

and accumulates, per output channel, the error power relative to the channel's power
``|y_c - y_q,c|^2 / |y_c|^2`` over the real (unpadded) tokens, averaged over channels (a channel
crushed by another's outlier counts fully whatever its scale, even if a later op scales it up).
``float`` has no error. The search checks its decisions on the converted model's output.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call

from qplug_core.algorithms._layers import layer_of
from qplug_core.algorithms.sensitivity import float_output
from qplug_core.flows.freed_memory import give_back_freed_memory
from qplug_core.kernels.per_token import QMAX, per_token_quantize, symmetric_per_channel_int8
from qplug_core.qparams import QParams, compute_qparams, fake_quantize

__all__ = ["LayerError", "layer_errors"]


@dataclass
class LayerError:
    """Relative output error power of one layer per way of running it (``static``, fallbacks)."""

    name: str
    errors: dict[str, float] = field(default_factory=dict)


@dataclass
class _Accumulator:
    """Error and signal power per output channel (``axis``), over the real tokens."""

    axis: int
    noise: dict[str, torch.Tensor] = field(default_factory=dict)
    power: torch.Tensor | None = None

    def _per_channel(self, t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None and self.axis == -1:  # token rows [batch, tokens, channels]
            t = t[rows]
        squares = t.float().square().movedim(self.axis, -1)
        return squares.reshape(-1, squares.shape[-1]).sum(0, dtype=torch.float64)

    def add_reference(self, want: torch.Tensor, rows: torch.Tensor | None) -> None:
        power = self._per_channel(want, rows)
        self.power = power if self.power is None else self.power + power

    def add(self, kind: str, want: torch.Tensor, got: torch.Tensor, rows: torch.Tensor | None) -> None:
        noise = self._per_channel(want - got, rows)
        self.noise[kind] = noise if kind not in self.noise else self.noise[kind] + noise

    def errors(self) -> dict[str, float]:
        """Mean over channels of each channel's error power relative to its signal power: a
        channel crushed by another's outlier counts fully, whatever its scale."""
        if self.power is None:
            return {}
        power = self.power.clamp_min(1e-30)
        return {k: float((v / power).clamp_max(1.0).mean()) for k, v in self.noise.items()}


def _observer_before(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    arg = node.args[0] if node.args else None
    if isinstance(arg, fx.Node) and arg.op == "call_module" and hasattr(modules.get(arg.target), "qparams"):
        return modules[arg.target]
    return None


def _observer_after(node: fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    for user in node.users:
        if user.op == "call_module" and hasattr(modules.get(user.target), "qparams"):
            return modules[user.target]
    return None


def _weight_qparams(observer_factory: Any, weight: torch.Tensor) -> QParams:
    observer = observer_factory()
    observer(weight.detach())
    return observer.qparams()


def _dynamic_input(observer_factory: Any, x: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """``x`` (rows of ``batch``) on the grid a dynamic kernel picks at run time: the whole batch's
    range, padding included, the dynamic qconfig's integer range (7-bit where the backend reduces
    it)."""
    observer = observer_factory()
    scale, zero_point = compute_qparams(batch.min(), batch.max(), dtype=observer.dtype,
                                        qscheme=torch.per_tensor_affine,
                                        quant_min=observer.quant_min, quant_max=observer.quant_max)
    return fake_quantize(x, QParams(scale.reshape(()), zero_point.reshape(()), observer.dtype,
                                    observer.quant_min, observer.quant_max))


def _per_token_weight(layer: nn.Linear, qmax: int) -> torch.Tensor:
    weight, weight_scale = symmetric_per_channel_int8(layer.weight, qmax)
    return weight.float() * weight_scale[:, None]


def _per_token_linear(layer: nn.Linear, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    q, scale, zero_point = per_token_quantize(x.float().contiguous())
    return nn.functional.linear((q.float() - zero_point) * scale, weight, layer.bias)


def _after(module: nn.Module, layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """What a fused container (``LinearReLU``) computes after its weighted layer."""
    for child in (list(module)[1:] if module is not layer else []):
        y = child(y)
    return y


@torch.no_grad()
def layer_errors(gm: fx.GraphModule, observed: fx.GraphModule, layers: list[str],
                 batches: list[tuple], masks: list[torch.Tensor | None], *,
                 static_weight: dict[str, Any], dynamic_qconfig: Any, fallbacks: tuple[str, ...],
                 per_token_qmax: int = QMAX) -> tuple[list[LayerError], list[torch.Tensor]]:
    """(errors of ``layers`` of the fused float ``gm``, float outputs of ``gm`` on ``batches``).

    ``observed`` is ``gm`` prepared and calibrated (same node names): each layer's input and
    output observers give the static grids; ``static_weight`` maps a layer to its qconfig's weight
    observer factory, ``dynamic_qconfig`` is the backend's dynamic Linear qconfig,
    ``per_token_qmax`` the per-token GEMM's weight range (7 bits where it sums pairs in int16).
    The float outputs come from the same pass (the scores need them)."""
    observed_modules = dict(observed.named_modules(remove_duplicate=False))
    nodes = {n.target: n for n in observed.graph.nodes if n.op == "call_module"}
    float_nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    accumulators = {name: _Accumulator(-1 if isinstance(layer_of(gm, float_nodes[name]), nn.Linear) else 1)
                    for name in layers}
    state: dict[str, Any] = {"mask": None, "inside": False}

    def hook_for(name: str):
        module = gm.get_submodule(name)
        layer = layer_of(gm, float_nodes[name])
        prefix = next(p for p, m in module.named_modules() if m is layer)
        weight_key = f"{prefix}.weight" if prefix else "weight"
        node = nodes.get(name)
        before = _observer_before(node, observed_modules) if node is not None else None
        after = _observer_after(node, observed_modules) if node is not None else None
        # the calibrated grids once per layer; the weights on them at each call, not held: every
        # layer's three rounded copies at once were 2.3x BERT-base's float bytes at the peak
        static_grid = _weight_qparams(static_weight[name], layer.weight)
        grid_in = before.qparams() if before is not None else None
        grid_out = after.qparams() if after is not None else None
        plain = type(layer) is nn.Linear
        per_token = plain and "per_token" in fallbacks
        dynamic_grid = _weight_qparams(dynamic_qconfig.weight, layer.weight) \
            if plain and "dynamic" in fallbacks else None

        def hook(mod: nn.Module, args: tuple, output: Any) -> None:
            x = args[0]
            if state["inside"] or not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
                return  # the simulated calls below run the module (and so this hook) again
            mask = state["mask"]
            rows = (mask != 0) if mask is not None and tuple(x.shape[:2]) == tuple(mask.shape) else None
            acc = accumulators[name]
            batch = x
            if rows is not None and acc.axis == -1:
                # a linear's token rows: simulate the real ones only (padding is most of a batch
                # padded to a fixed length, and is never scored)
                x, output, rows = x[rows], output[rows], None
            acc.add_reference(output, rows)
            if grid_in is not None:
                state["inside"] = True
                try:
                    static_w = fake_quantize(layer.weight, static_grid)
                    y = functional_call(mod, {weight_key: static_w}, (fake_quantize(x, grid_in),))
                finally:
                    state["inside"] = False
                if grid_out is not None:
                    y = fake_quantize(y, grid_out)
                acc.add("static", output, y, rows)
            if per_token:
                token_w = _per_token_weight(layer, per_token_qmax)
                acc.add("per_token", output, _after(mod, layer, _per_token_linear(layer, token_w, x)), rows)
            if dynamic_grid is not None:
                y = nn.functional.linear(_dynamic_input(dynamic_qconfig.activation, x, batch),
                                         fake_quantize(layer.weight, dynamic_grid), layer.bias)
                acc.add("dynamic", output, _after(mod, layer, y), rows)
        return hook

    outputs = []
    with ExitStack() as stack:
        for name in layers:
            stack.callback(gm.get_submodule(name).register_forward_hook(hook_for(name)).remove)
        for batch, mask in zip(batches, masks):
            state["mask"] = mask
            outputs.append(float_output(gm, batch))
            # each layer's simulated weights (temporaries of its size) land in the holes the
            # converted model's freed float weights left: returned after each batch, the pass no
            # longer brings the whole heap back (BERT-base: ~3.0x -> ~2.1x its float bytes here)
            give_back_freed_memory()
    return [LayerError(name, accumulators[name].errors()) for name in layers], outputs

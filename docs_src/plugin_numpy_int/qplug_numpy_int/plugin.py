"""The ``numpy_int`` backend: int8 Linear (+ReLU) partitions compiled into a numpy integer program."""

from __future__ import annotations

import numpy as np
import torch
from torch import fx, nn

from qplug_core.plugin_api import (
    BackendPlugin,
    Delegate,
    Dequantize,
    DTypeConfig,
    OperatorSupportBase,
    Quantize,
    ReferenceWeighted,
    linear_pattern_configs,
)

LINEAR_INT8 = DTypeConfig(input_dtype=torch.quint8, output_dtype=torch.quint8,
                          weight_dtype=torch.qint8, bias_dtype=torch.float)
RELUS = (nn.ReLU, torch.relu, torch.nn.functional.relu)


def _module(submodules, node):
    return submodules.get(str(node.target)) if node.op == "call_module" else None


class TakesLinearReLU(OperatorSupportBase):
    """Quantize/Dequantize, int8 Linear or LinearReLU, and ReLU; everything else stays in PyTorch."""

    def is_node_supported(self, submodules, node) -> bool:
        module = _module(submodules, node)
        if isinstance(module, ReferenceWeighted):
            return isinstance(module.module, nn.Linear) or (
                isinstance(module.module, nn.Sequential) and isinstance(module.module[0], nn.Linear))
        return isinstance(module, (Quantize, Dequantize, nn.ReLU)) or node.target in RELUS[1:]


class NumpyProgram(nn.Module):
    """One partition as numpy steps: integer matmuls into int32 accumulators, requantized."""

    def __init__(self, partition: fx.GraphModule):
        super().__init__()
        self.graph_module = partition  # interpreted step by step; its modules hold the qparams

    def forward(self, *inputs: torch.Tensor):
        env, modules = {}, dict(self.graph_module.named_modules())
        placeholders = iter(inputs)
        for node in self.graph_module.graph.nodes:
            args = [env[a] if isinstance(a, fx.Node) else a for a in node.args]
            module = _module(modules, node)
            if node.op == "placeholder":
                env[node] = ("int", next(placeholders).numpy(), 1.0, 0)
            elif isinstance(module, Dequantize):  # keep the integers and their scale
                _, q, _, _ = args[0]
                env[node] = ("deq", q, float(module.scale), int(module.zero_point))
            elif isinstance(module, ReferenceWeighted):
                env[node] = ("float", _linear(module, *args[0][1:]))
            elif isinstance(module, Quantize):
                info = np.iinfo(np.uint8 if module.dtype == torch.quint8 else np.int8)
                q = np.rint(_value(args[0]) / float(module.scale)) + int(module.zero_point)
                env[node] = ("int", np.clip(q, info.min, info.max).astype(info.dtype), 1.0, 0)
            elif node.op == "output":  # one value, or a tuple of them
                several = isinstance(node.args[0], (tuple, list))
                values = [env[n] for n in node.args[0]] if several else [args[0]]
                outputs = [torch.from_numpy(np.ascontiguousarray(_value(v))) for v in values]
                return tuple(outputs) if several else outputs[0]
            else:  # a ReLU
                env[node] = ("float", np.maximum(_value(args[0]), 0))
        raise RuntimeError("the partition has no output")


def _value(v: tuple) -> np.ndarray:
    """What a value holds: integers (model inputs, Quantize outputs) or floats (a Dequantize
    output is its integers scaled back; a linear's output is float already)."""
    if v[0] == "deq":
        return ((v[1].astype(np.int32) - v[3]) * v[2]).astype(np.float32)
    return v[1]


def _linear(module: ReferenceWeighted, q: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """int32 accumulation of (q - zp) x int8 weights, scaled back to float (+ bias, + ReLU)."""
    linear = module.module[0] if isinstance(module.module, nn.Sequential) else module.module
    w = module.weight_qparams
    w_scale = w.scale.reshape(-1, 1) if w.per_channel else w.scale
    weight = torch.round(linear.weight.detach() / w_scale).to(torch.int32).numpy()
    acc = (q.astype(np.int32) - zero_point) @ weight.T
    out = acc * (scale * w_scale.reshape(-1).numpy())
    if linear.bias is not None:
        out = out + linear.bias.detach().numpy()
    relu = isinstance(module.module, nn.Sequential) and len(module.module) > 1
    return np.maximum(out, 0) if relu else out.astype(np.float32)


class NumpyIntPlugin(BackendPlugin):
    name = "numpy_int"
    description = "int8 Linear (+ReLU) partitions run by a numpy integer program (docs example)"

    def pattern_configs(self):
        return linear_pattern_configs([LINEAR_INT8])  # Linear, F.linear, Linear+ReLU fusion, ...

    def qconfig_options(self, mode):
        return {"per_channel": True}

    def delegate(self) -> Delegate:
        return Delegate(operator_support=TakesLinearReLU(),
                        compile=lambda partition, example_inputs: NumpyProgram(partition))


plugin = NumpyIntPlugin()

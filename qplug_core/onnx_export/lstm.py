"""A dynamic int8 ``nn.LSTM`` of the reference form as ``qplug::dynamic_quantized_lstm`` calls.

The reference form runs a float ``nn.LSTM`` whose weights lie on their int8 grid, after a dynamic
quantization of its input. :class:`DynamicQuantizedLSTM` recovers the integers and scales of that
grid exactly (checked: dequantizing them gives the reference weights back to float rounding), reorders
them into ONNX's layout and calls one ``qplug::dynamic_quantized_lstm`` per layer, which ONNX
Runtime runs as ``com.microsoft.DynamicQuantizeLSTM``: ORT runs qplug's int8 weights, it does not
quantize the float weights again. batch_first, stacked and bidirectional layers, unbatched input
and ``(h0, c0)`` keep ``nn.LSTM``'s behaviour.
"""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from qplug_core.errors import ExportError
from qplug_core.kernels.reference import DynamicQuantize, ReferenceRecurrent

#: PyTorch's gate blocks (i, f, g, o) in ONNX's order (i, o, f, c)
_ONNX_GATE_ORDER = (0, 3, 1, 2)
#: the largest integer of a symmetric int8 grid: 64 and 63 for the 7-bit weights a CPU without VNNI
#: gets, 127 (128 on [-128, 127]) for 8 bits. Smallest first: a 7-bit grid is also an 8-bit one
#: with even integers, and the kernel must get the small integers, whose int16 pair sums cannot
#: saturate (the dequantized weight is the same either way)
_GRID_TOPS = (64, 63, 127, 128)
#: a recovered weight may differ from the reference one by float rounding of the step, no more
_ULPS = 4 * torch.finfo(torch.float32).eps


def int8_grid(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(int8 [rows, cols], float scale [rows])`` that dequantize to ``weight`` (to float rounding), or None
    when ``weight`` does not lie on a symmetric int8 grid (zero point 0).

    A symmetric observer maps a row's (per-channel) or the matrix's (per-tensor) largest magnitude
    to 127, to 128 on a [-128, 127] range, or to 64 / 63 with 7-bit weights: those are the steps
    tried, row by row.
    """
    weight = weight.detach().to(torch.float32)
    for amax in (weight.abs().amax(1, keepdim=True), weight.abs().max().expand(weight.shape[0], 1)):
        q, step = torch.zeros_like(weight), torch.ones_like(amax)
        found = torch.zeros(weight.shape[0], dtype=torch.bool)
        for top in _GRID_TOPS:
            candidate = torch.where(amax > 0, amax / top, torch.ones_like(amax))
            rounded = torch.round(weight / candidate)
            close = (rounded * candidate - weight).abs() <= _ULPS * amax  # the step is amax / top, rounded
            fits = (close & (rounded >= -128) & (rounded <= 127)).all(1) & ~found
            q[fits], step[fits], found = rounded[fits], candidate[fits], found | fits
        if bool(found.all()):
            return q.to(torch.int8), step.reshape(-1)
    return None


def _onnx_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Gate blocks along dim 0 from PyTorch's order to ONNX's."""
    blocks = tensor.chunk(4, 0)
    return torch.cat([blocks[i] for i in _ONNX_GATE_ORDER])


def lstm_problem(lstm: nn.Module) -> str | None:
    """Why ``lstm`` cannot run as DynamicQuantizeLSTM (None when it can)."""
    if type(lstm) is not nn.LSTM:
        return f"{type(lstm).__name__} is not an nn.LSTM: ONNX Runtime's only dynamic int8 recurrent op is DynamicQuantizeLSTM"
    if lstm.proj_size:
        return "proj_size is set: DynamicQuantizeLSTM has no projection"
    for name in lstm._flat_weights_names:
        if name.startswith("weight") and int8_grid(getattr(lstm, name)) is None:
            return f"{name} does not lie on a symmetric int8 grid (zero point 0), which DynamicQuantizeLSTM needs"
    return None


def dynamic_lstm_problem(submodules: dict[str, nn.Module], node: fx.Node) -> str | None:
    """Why the reference-form LSTM call ``node`` cannot run as DynamicQuantizeLSTM, None when it
    can: it must be a dynamically quantized ``nn.LSTM`` (uint8 [0, 255] input quantization, int8
    grid weights) whose tuple output is only indexed (a compiled partition returns tensors)."""
    module = submodules.get(str(node.target)) if node.op == "call_module" else None
    if module is None:
        return "not a module call"
    if isinstance(module, ReferenceRecurrent):
        module = module.module
    source = node.args[0] if node.args else None
    quantize = submodules.get(str(source.target)) if isinstance(source, fx.Node) and source.op == "call_module" else None
    if not isinstance(quantize, DynamicQuantize):
        return "its input is not dynamically quantized: the LSTM is not quantized (qconfig None)"
    if (quantize.dtype, quantize.quant_min, quantize.quant_max) != (torch.quint8, 0, 255):
        return (f"its input is quantized to {quantize.dtype} [{quantize.quant_min}, {quantize.quant_max}]; "
                "DynamicQuantizeLSTM quantizes to uint8 [0, 255]")
    problem = lstm_problem(module)
    if problem:
        return problem
    if not _only_indexed(node):
        return "its (output, (h, c)) tuple is used as a whole; a compiled partition returns tensors"
    return None


def _only_indexed(node: fx.Node) -> bool:
    """Every use of the LSTM's ``(output, (h, c))`` indexes it down to tensors."""
    def indexing(user: fx.Node) -> bool:
        return user.op == "call_function" and user.target is operator.getitem
    return all(indexing(user) and (user.args[1] != 1 or all(indexing(u) for u in user.users))
               for user in node.users)


class DynamicQuantizedLSTM(nn.Module):
    """``nn.LSTM``'s ``forward(x, (h0, c0)=None) -> (out, (h, c))`` with the reference LSTM's int8
    weights, one ``qplug::dynamic_quantized_lstm`` call per layer (see the module docstring)."""

    def __init__(self, lstm: nn.LSTM):
        super().__init__()
        problem = lstm_problem(lstm)
        if problem:
            raise ExportError(f"this LSTM cannot be exported as DynamicQuantizeLSTM: {problem}")
        self.num_layers, self.hidden_size = lstm.num_layers, lstm.hidden_size
        self.batch_first, self.directions = lstm.batch_first, 2 if lstm.bidirectional else 1
        for layer in range(lstm.num_layers):
            parts: dict[str, list[torch.Tensor]] = {"w": [], "ws": [], "r": [], "rs": [], "b": []}
            for suffix in ("", "_reverse")[: self.directions]:
                for kind, scale_kind, name in (("w", "ws", "ih"), ("r", "rs", "hh")):
                    q, scale = int8_grid(getattr(lstm, f"weight_{name}_l{layer}{suffix}"))  # type: ignore[misc]
                    parts[kind].append(_onnx_rows(q).t().contiguous())
                    parts[scale_kind].append(_onnx_rows(scale))
                parts["b"].append(torch.cat([_onnx_rows(self._bias(lstm, f"bias_{name}_l{layer}{suffix}"))
                                             for name in ("ih", "hh")]))
            for kind, tensors in parts.items():
                self.register_buffer(f"{kind}{layer}", torch.stack(tensors))

    def _bias(self, lstm: nn.LSTM, name: str) -> torch.Tensor:
        bias = getattr(lstm, name, None) if lstm.bias else None
        return torch.zeros(4 * self.hidden_size) if bias is None else bias.detach().to(torch.float32)

    def forward(self, x: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None):
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1)
            hx = None if hx is None else (hx[0].unsqueeze(1), hx[1].unsqueeze(1))
        elif self.batch_first:
            x = x.transpose(0, 1)
        seq, batch = x.shape[0], x.shape[1]
        hs, cs = [], []
        for layer in range(self.num_layers):
            states = slice(layer * self.directions, (layer + 1) * self.directions)
            h0, c0 = (None, None) if hx is None else (hx[0][states], hx[1][states])  # None: zeros
            y, h, c = torch.ops.qplug.dynamic_quantized_lstm(
                x, getattr(self, f"w{layer}"), getattr(self, f"ws{layer}"), getattr(self, f"r{layer}"),
                getattr(self, f"rs{layer}"), getattr(self, f"b{layer}"), h0, c0)
            x = y.transpose(1, 2).reshape(seq, batch, self.directions * self.hidden_size)
            hs.append(h)
            cs.append(c)
        h_n, c_n = torch.cat(hs), torch.cat(cs)
        if unbatched:
            return x.squeeze(1), (h_n.squeeze(1), c_n.squeeze(1))
        return (x.transpose(0, 1) if self.batch_first else x), (h_n, c_n)


__all__ = ["DynamicQuantizedLSTM", "dynamic_lstm_problem", "int8_grid", "lstm_problem"]

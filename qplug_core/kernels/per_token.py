"""Dynamic int8 linear with one activation scale per token and one weight scale per channel.

Per-tensor dynamic activations share one scale across every token of a batch, so one token with
an outlier (trained transformers have them in the residual stream and the FFN output) costs every
other token its resolution. Here each row of the input gets its own asymmetric 8-bit grid,
weights get a symmetric scale per output channel, and the int8 x int8 product accumulates in
int32 through ``torch._int_mm`` (plain int8 tensors: no quantized dtypes), then is rescaled by
the two scale vectors, the zero point's share removed with precomputed weight column sums.

On real all-MiniLM-L6-v2 weights this keeps the sentence-embedding cosine at 0.998+ where
per-tensor dynamic gets 0.994 (docs/guide/accuracy.md has the figures and the command).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from qplug_core.errors import ConfigValidationError

__all__ = ["PerTokenDynamicLinear", "per_token_quantize", "symmetric_per_channel_int8"]

QMAX = 127  # symmetric [-127, 127]: -128 is never produced, so negation is exact
_EPS = torch.finfo(torch.float32).eps


@torch.no_grad()
def per_token_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 tensor, scale ``[..., 1]``, zero point ``[..., 1]``) per token (last dimension).

    Asymmetric: each token's [min, max] (with 0) maps onto 256 levels, stored as int8 with the
    zero point shifted by -128 (``x ~ (q - zero_point) * scale``). Activations after GELU or ReLU
    are nearly one-sided, so a symmetric grid would waste half its levels on them: on MiniLM
    this takes the embedding cosine from 0.9973 (symmetric) to 0.9989.
    """
    # two vectorized reductions: torch.aminmax over the last dim is ~10x slower on CPU
    low = x.amin(dim=-1, keepdim=True).clamp_max_(0)
    high = x.amax(dim=-1, keepdim=True).clamp_min_(0)
    scale = (high - low).clamp_min_(_EPS).div_(255)
    zero_point = torch.round(-low / scale).sub_(128)
    work = torch.addcmul(zero_point, x, scale.reciprocal()).round_().clamp_(-128, 127)
    return work.to(torch.int8), scale, zero_point


class _PerThread(threading.local):
    """Per-thread scratch state that copies and pickles as empty (it is only a cache)."""

    def __reduce__(self) -> tuple:
        return (type(self), ())

    def __deepcopy__(self, memo: dict) -> _PerThread:
        return type(self)()


class SharedInput:
    """The last input quantized by any of a model's per-token linears, reused while unchanged.

    Attention's query, key and value projections read the same tensor; quantizing it once
    instead of three times saves a third of the per-token overhead. A hit needs the very same
    tensor object at the same version counter (no in-place change since). The cache is per
    thread, so one model can serve several threads.
    """

    def __init__(self) -> None:
        self._local = _PerThread()

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        state = self._local
        source = state.source() if getattr(state, "source", None) is not None else None
        if source is x and x._version == state.version:
            return state.quantized
        state.quantized = per_token_quantize(x)
        state.source, state.version = weakref.ref(x), x._version
        return state.quantized


def symmetric_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float scale per output channel) with the symmetric [-127, 127] grid."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp_min(_EPS) / QMAX
    return torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8), scale


class PerTokenDynamicLinear(nn.Module):
    """``nn.Linear`` computed as int8 x int8 -> int32 with per-token and per-channel scales.

    ``simulate=True`` does the same arithmetic with float matmuls (the reference backend, and
    the oracle the int8 path is tested against).
    """

    def __init__(self, weight_int8: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, *, simulate: bool = False,
                 shared: SharedInput | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight_int8.shape[1], weight_int8.shape[0]
        self.register_buffer("weight_int8_t", weight_int8.t().contiguous())  # [K, N] for _int_mm
        self.register_buffer("weight_scale", weight_scale.float())
        # sum over k of w[k, n] * weight_scale[n]: removes the activation zero point's share
        self.register_buffer("column_sums", weight_int8.float().sum(1) * weight_scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.simulate = simulate
        self.shared = shared
        self._scratch = _PerThread()  # int32 accumulator per thread, reused while shapes repeat

    @classmethod
    def from_float(cls, linear: nn.Module, *, simulate: bool = False,
                   shared: SharedInput | None = None) -> PerTokenDynamicLinear:
        if not isinstance(linear, nn.Linear):
            raise ConfigValidationError(f"PerTokenDynamicLinear converts nn.Linear, got "
                                        f"{type(linear).__name__}", field="module")
        weight, scale = symmetric_per_channel_int8(linear.weight)
        return cls(weight, scale, linear.bias, simulate=simulate, shared=shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            x = x.float()
        q, scale, zero_point = (self.shared.quantize(x) if self.shared is not None
                                else per_token_quantize(x))
        q = q.reshape(-1, self.in_features)
        scale, zero_point = scale.reshape(-1, 1), zero_point.reshape(-1)
        if self.simulate:
            acc = (q.double() @ self.weight_int8_t.double()).float()  # exact int sums
        else:
            acc = getattr(self._scratch, "acc", None)
            if acc is None or acc.shape[0] != q.shape[0]:
                acc = self._scratch.acc = torch.empty(q.shape[0], self.out_features,
                                                      dtype=torch.int32)
            torch._int_mm(q, self.weight_int8_t, out=acc)
        # (q - zp) W s_w s_x + b, with the zero-point term as one rank-1 update
        out = acc.float().mul_(self.weight_scale)  # int32 * float is a slow unvectorized path
        out.addr_(zero_point, self.column_sums, alpha=-1.0)
        if self.bias is not None:
            torch.addcmul(self.bias, out, scale, out=out)
        else:
            out.mul_(scale)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kind = "simulated" if self.simulate else "torch._int_mm"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, {kind}")

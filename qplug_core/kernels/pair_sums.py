"""Whether u8 x s8 pair sums saturate int16 for one layer's real operands (x86 without VNNI).

Without VNNI, FBGEMM, oneDNN and ONNX Runtime's MLAS multiply u8 activation codes by s8 weight
codes with ``vpmaddubsw``: two *adjacent* products along the reduction axis K are added into
int16 with saturation, then widened and summed in int32. With full 8-bit operands a pair can reach
2 * 255 * 127 = 64,770, but whether one does depends on the values: which codes sit next to which
weights. This module answers it for one layer, so the core can keep 8-bit weights where no pair
saturates (``qplug_core.flows.weight_bits``).

The K order is that of the kernels' packing: ``in_features`` for a linear layer; for a
convolution the channels-last im2col the x86 kernels use (FBGEMM's NHWC convs, ORT's NHWC
``QLinearConv``): ``(kh, kw, c_in)`` with the input channels of a group innermost, so a pair is
two adjacent input channels under the same kernel tap (two adjacent taps for a depthwise conv).

It is computed in two steps. A bound over the observed range first: with each K column's codes
in ``[min, max]`` over the data, a pair can reach at most ``w0 * a0 + w1 * a1`` with each ``a``
at the end of its range that has the sign of its weight; pairs whose bound fits int16 cannot
saturate. Only the pairs left are computed on the data, row by row, and what saturation takes
from each output is added up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

INT16_MAX = 32767
#: at most this many (row x pair) products are computed at once (memory, not correctness)
_CHUNK = 1 << 23


def supported(module: nn.Module) -> bool:
    """Whether :func:`operands` knows ``module``'s K order."""
    return isinstance(module, nn.Linear) or (isinstance(module, nn.Conv2d)
                                             and not isinstance(module.padding, str))


def operands(module: nn.Module, codes: torch.Tensor, zero_point: int, max_rows: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u8 activation codes of ``module``'s GEMM ``[groups, rows, K]`` in the kernels' K order,
    and the highest and lowest code of each K column over *all* rows, ``[groups, K]``).

    ``codes``: the layer's input codes (a float tensor of integers), as the kernel gets them;
    ``zero_point``: their zero point (the code of the padding, the real value 0); ``max_rows``:
    keep at most this many GEMM rows, evenly spread (the column ranges still see every row; for
    a convolution they are its input channels' ranges, padding included)."""
    if isinstance(module, nn.Linear):
        a = codes.reshape(-1, codes.shape[-1])
        high, low = a.amax(0, keepdim=True), a.amin(0, keepdim=True)
        return a[_rows(a.shape[0], max_rows)][None], high, low
    kh, kw = module.kernel_size
    (sh, sw), (dh, dw), (ph, pw) = module.stride, module.dilation, module.padding
    batch, channels, height, width = codes.shape
    groups = module.groups
    high, low = codes.amax((0, 2, 3)), codes.amin((0, 2, 3))
    if ph or pw:
        high, low = high.clamp_min(zero_point), low.clamp_max(zero_point)
    padded = nn.functional.pad(codes - zero_point, (pw, pw, ph, ph)).add_(zero_point).permute(0, 2, 3, 1)
    out_h = (height + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    out_w = (width + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    rows = _rows(batch * out_h * out_w, max_rows)
    b, oy, ox = rows // (out_h * out_w), rows // out_w % out_h, rows % out_w
    iy = oy[:, None] * sh + torch.arange(kh) * dh  # [M, kh]
    ix = ox[:, None] * sw + torch.arange(kw) * dw  # [M, kw]
    a = padded[b[:, None, None], iy[:, :, None], ix[:, None, :]]  # [M, kh, kw, C]
    a = a.reshape(len(rows), kh * kw, groups, channels // groups).permute(2, 0, 1, 3)
    def by_k(per_channel: torch.Tensor) -> torch.Tensor:
        return per_channel.reshape(groups, 1, channels // groups).expand(-1, kh * kw, -1).reshape(groups, -1)
    return a.reshape(groups, len(rows), -1), by_k(high), by_k(low)


def _rows(total: int, max_rows: int | None) -> torch.Tensor:
    if max_rows is None or total <= max_rows:
        return torch.arange(total)
    return torch.linspace(0, total - 1, max_rows).long()


def weight_operands(module: nn.Module, codes: torch.Tensor) -> torch.Tensor:
    """The s8 weight ``codes`` as ``[groups, outputs per group, K]``, K ordered as in
    :func:`operands`."""
    if isinstance(module, nn.Linear):
        return codes.reshape(1, *codes.shape)
    out, channels, kh, kw = codes.shape
    return codes.permute(0, 2, 3, 1).reshape(module.groups, out // module.groups, kh * kw * channels)


@dataclass
class PairSums:
    """What ``vpmaddubsw`` does to one GEMM: how many pair sums leave int16, and by how much each
    output falls short of the exact sum (code units, ``[G, rows, N]``)."""

    saturated: int
    shortfall: torch.Tensor


def pair_sums(a: torch.Tensor, w: torch.Tensor, high: torch.Tensor | None = None,
              low: torch.Tensor | None = None) -> PairSums:
    """The int16 pair sums of ``a @ w.T`` as x86 without VNNI computes them (a: ``[G, M, K]`` u8
    codes, w: ``[G, N, K]`` s8 codes, per group). ``high``/``low`` (``[G, K]``): each K column's
    code range, if wider than these rows' (the rows being a sample)."""
    high = a.amax(1) if high is None else high
    low = a.amin(1) if low is None else low
    if a.shape[-1] % 2:
        a, w = nn.functional.pad(a, (0, 1)), nn.functional.pad(w, (0, 1))
        high, low = nn.functional.pad(high, (0, 1)), nn.functional.pad(low, (0, 1))
    a, w, high, low = a.to(torch.int32), w.to(torch.int32), high.to(torch.int32), low.to(torch.int32)
    reach_up = torch.where(w > 0, w * high[:, None], w * low[:, None])  # the largest product
    reach_down = torch.where(w < 0, w * high[:, None], w * low[:, None])  # the smallest
    up = reach_up[..., 0::2] + reach_up[..., 1::2]
    down = reach_down[..., 0::2] + reach_down[..., 1::2]
    suspects = ((up > INT16_MAX) | (down < -INT16_MAX - 1)).nonzero()  # [F, 3]: group, n, pair
    shortfall = torch.zeros(a.shape[0], a.shape[1], w.shape[1], dtype=torch.int64)
    saturated = 0
    step = max(1, _CHUNK // max(a.shape[1], 1))
    for start in range(0, suspects.shape[0], step):
        g, n, p = suspects[start:start + step].unbind(1)
        pairs = (a[g, :, 2 * p] * w[g, n, 2 * p][:, None]
                 + a[g, :, 2 * p + 1] * w[g, n, 2 * p + 1][:, None])  # [F, M]
        lost = (pairs - pairs.clamp(-INT16_MAX - 1, INT16_MAX)).long()
        saturated += int((lost != 0).sum())
        shortfall.index_put_((g[:, None], torch.arange(a.shape[1])[None, :], n[:, None]), lost,
                             accumulate=True)
    return PairSums(saturated, shortfall)


__all__ = ["INT16_MAX", "PairSums", "operands", "pair_sums", "supported", "weight_operands"]

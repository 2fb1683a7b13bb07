"""Weight-only schemes: how a float weight becomes integers, scales and zero points, and back.

One layout for every kernel and for files: a weight ``[N, K]`` (out, in features) is cut into
groups of ``group_size`` consecutive input features per output row; each group has a float32 scale
and an integer zero point, and ``w = (q - zero_point) * scale``. Integers are stored unsigned
(``0 .. 2**bits - 1``); a symmetric scheme has the fixed zero point ``2**(bits - 1)`` and stores
none. 4-bit values are packed two per byte along K, the even feature in the low nibble, which is
ONNX Runtime's ``MatMulNBits`` layout, so packing for it copies nothing that needs reordering.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qplug_core.errors import ConfigValidationError

SUPPORTED_BITS = (4, 8)


@dataclass(frozen=True)
class WeightOnlyScheme:
    """``bits`` per weight, ``group_size`` input features per scale (``None``: one per output
    channel) and whether the zero point is fixed (``symmetric``)."""

    bits: int = 8
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ConfigValidationError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits!r}",
                                        field="bits", value=self.bits)
        if self.group_size is not None and (not isinstance(self.group_size, int) or self.group_size < 2
                                            or self.group_size % 2):
            raise ConfigValidationError(
                f"group_size must be an even int >= 2 (e.g. 32, 64, 128) or None for one scale per output "
                f"channel, got {self.group_size!r}", field="group_size", value=self.group_size)

    @property
    def qmax(self) -> int:
        return 2 ** self.bits - 1

    @property
    def midpoint(self) -> int:
        """The zero point of a symmetric scheme."""
        return 2 ** (self.bits - 1)

    def groups(self, in_features: int) -> int:
        """Groups per row; a group size that does not divide ``in_features`` is an error."""
        size = self.group_size or in_features
        if in_features % size:
            raise ConfigValidationError(
                f"group_size {size} does not divide the layer's {in_features} input features; pick a "
                "divisor or skip the layer", field="group_size", value=size)
        return in_features // size

    def to_dict(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size, "symmetric": self.symmetric}

    @classmethod
    def from_dict(cls, data: dict) -> WeightOnlyScheme:
        return cls(bits=int(data["bits"]), group_size=data["group_size"], symmetric=bool(data["symmetric"]))


@dataclass
class QuantizedWeight:
    """A quantized ``[N, K]`` weight: ``data`` (uint8; ``[N, ceil(K/2)]`` packed for 4 bits),
    ``scales`` float32 ``[N, groups]``, ``zero_points`` uint8 ``[N, groups]`` or ``None``."""

    scheme: WeightOnlyScheme
    shape: tuple[int, int]
    data: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None = None

    @property
    def group_size(self) -> int:
        return self.scheme.group_size or self.shape[1]

    def integers(self) -> torch.Tensor:
        """The unsigned integers ``[N, K]`` (int16, so subtracting a zero point cannot wrap)."""
        return unpack(self.data, self.scheme.bits, self.shape[1]).to(torch.int16)

    def zero_point_tensor(self) -> torch.Tensor:
        """Zero points ``[N, groups]``, the fixed midpoint for a symmetric scheme."""
        if self.zero_points is not None:
            return self.zero_points
        return torch.full_like(self.scales, self.scheme.midpoint, dtype=torch.uint8)

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Output rows ``start:stop`` (``0 <= start < N``; views, no copy): the definition of a big
        weight a block at a time."""
        zero_points = None if self.zero_points is None else self.zero_points[start:stop]
        return QuantizedWeight(self.scheme, (min(stop, self.shape[0]) - start, self.shape[1]),
                               self.data[start:stop], self.scales[start:stop], zero_points)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(q - zero_point) * scale`` as a dense ``[N, K]`` tensor (the definition)."""
        n, k = self.shape
        g = self.group_size
        q = self.integers().view(n, k // g, g)
        zp = self.zero_point_tensor().to(torch.int16)[..., None]
        return ((q - zp).to(dtype) * self.scales.to(dtype)[..., None]).view(n, k)


def quantize(weight: torch.Tensor, scheme: WeightOnlyScheme,
             clip: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of ``weight`` ``[N, K]`` under ``scheme``.

    ``clip`` (``[N, groups]``, in ``(0, 1]``) shrinks each group's range before rounding; the
    data-aware algorithms search it. Without it this is plain RTN.
    """
    if weight.dim() != 2:
        raise ConfigValidationError(f"a weight-only weight must be 2-d [out, in], got shape "
                                    f"{tuple(weight.shape)}", field="weight")
    n, k = weight.shape
    groups = scheme.groups(k)
    w = weight.detach().to(torch.float32).reshape(n, groups, k // groups)
    tiny = torch.finfo(torch.float32).tiny
    if scheme.symmetric:
        amax = w.abs().amax(-1)
        if clip is not None:
            amax = amax * clip
        scales = (amax / (scheme.midpoint - 1)).clamp(min=tiny)
        zero_points = None
        zp = torch.full_like(scales, scheme.midpoint)
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        if clip is not None:
            low, high = low * clip, high * clip
        scales = ((high - low) / scheme.qmax).clamp(min=tiny)
        zp = torch.round(-low / scales).clamp(0, scheme.qmax)
        zero_points = zp.to(torch.uint8)
    q = torch.round(w / scales[..., None] + zp[..., None]).clamp(0, scheme.qmax).to(torch.uint8)
    return QuantizedWeight(scheme, (n, k), pack(q.view(n, k), scheme.bits), scales.contiguous(), zero_points)


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned integers ``[N, K]`` (uint8) to the stored layout (two per byte for 4 bits)."""
    if bits == 8:
        return q.contiguous()
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack(data: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """The stored layout back to unsigned integers ``[..., K]`` (uint8)."""
    if bits == 8:
        return data
    low, high = data & 0x0F, data >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)[..., :in_features]

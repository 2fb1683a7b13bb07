"""A measured answer to "do this backend's int8 kernels sum u8 x s8 pairs in int16 here?".

The CPU's flags say which instructions exist (``kernels/cpu.py``); what the installed kernels do
with them is another matter (a library may take a VNNI path, emulate one, or not: FBGEMM and
oneDNN held to AVX2 on a VNNI CPU saturate). Each backend's integer product is run once per
process (:func:`measured_pairs`) on the worst case for int16 pair sums (u8 codes of 255 against
weights of +127: each pair of products is 64,770, twice what int16 holds) and compared with the
exact product: saturated pairs give about half of it. ``qplug doctor`` reports it, and the safe
qparams follow it where the flags alone would call the kernels exact
(:func:`qplug_core.kernels.arithmetic.kernels_arithmetic`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from qplug_core.kernels.base import engine_context

#: (u8 codes [M, K], s8 weights [N, K]) -> the integer products [M, N] (any dtype holding them)
Gemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: the probe's sizes: one GEMM row, 64 products per output, 4 outputs
_M, _K, _N = 1, 64, 4
PAIRS_EXACT, PAIRS_SATURATE = "exact", "saturates"


def worst_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, weights, exact product) of the probe."""
    codes = torch.full((_M, _K), 255, dtype=torch.uint8)
    weights = torch.full((_N, _K), 127, dtype=torch.int8)
    return codes, weights, codes.long() @ weights.long().t()


def probe_pair_sums(gemm: Gemm) -> str:
    """``PAIRS_EXACT``, ``PAIRS_SATURATE`` (int16 pairs: about half the exact sum), or why the probe says
    nothing (it raised, or returned something else)."""
    codes, weights, exact = worst_case()
    try:
        with torch.no_grad():
            got = torch.as_tensor(gemm(codes, weights)).double().reshape(exact.shape)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run reports why
        return f"the probe failed ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})"
    if torch.equal(got.round(), exact.double()):
        return PAIRS_EXACT
    pairs = _K // 2 * torch.iinfo(torch.int16).max  # every pair clipped at int16's top
    if torch.allclose(got, torch.full_like(got, float(pairs)), rtol=0.02):
        return PAIRS_SATURATE
    return f"the probe returned {got.flatten()[:2].tolist()}, expected {float(exact[0, 0]):.0f}"


_measured: dict[str, str] = {}
_lock = threading.Lock()


def measured_pairs(backend: str, gemm: Gemm) -> str:
    """:func:`probe_pair_sums` of ``backend``'s ``gemm``, run once per process and backend (a
    small GEMM; ONNX Runtime's builds a session, ~10 ms)."""
    with _lock:
        if backend not in _measured:
            _measured[backend] = probe_pair_sums(gemm)
        return _measured[backend]


def torch_engine_gemm(engine: str) -> Gemm:
    """The product as ``torch.ops.quantized.linear`` computes it on ``engine``: activations of
    scale 1, weights of scale 1, the output on a grid whose top code is the exact product."""
    def gemm(codes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        exact_top = float(codes.double().max() * weights.double().sum(1).max())
        scale = exact_top / 255
        with engine_context(engine):
            x = torch._make_per_tensor_quantized_tensor(codes, 1.0, 0)
            w = torch._make_per_tensor_quantized_tensor(weights, 1.0, 0)
            packed = torch.ops.quantized.linear_prepack(w, None)
            out = torch.ops.quantized.linear(x, packed, scale, 0)
        return out.int_repr().double() * scale
    return gemm


__all__ = ["PAIRS_EXACT", "PAIRS_SATURATE", "Gemm", "measured_pairs", "probe_pair_sums", "torch_engine_gemm",
           "worst_case"]

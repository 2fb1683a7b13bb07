"""GPTQ (Frantar et al. 2022) for one linear layer: round one input feature at a time and let the
features not yet rounded absorb the error, weighted by the inverse Hessian ``(2 X^T X)^-1`` of
the layer's calibration inputs.

Groups are aligned with GPTQ's column blocks, so a group's scale and zero point are computed from
its columns as already updated by the rounding before it (no act-order: the features keep their
order, and the stored layout is the plain one). Inputs are recorded block by block
(:mod:`~qplug_core.weight_only.sequential`): a decoder block's linears see the outputs of the
blocks before it as already quantized, as in GPTQ's reference code.
"""

from __future__ import annotations

import torch

from qplug_core.kernels.weight_only_scheme import QuantizedWeight, WeightOnlyScheme, pack, quantize

#: dampening added to the Hessian's diagonal, as a fraction of its mean (GPTQ's default)
DAMPING = 0.01
_BLOCK = 128


def gptq_quantize(weight: torch.Tensor, x: torch.Tensor, scheme: WeightOnlyScheme) -> QuantizedWeight:
    """Quantize ``weight`` ``[N, K]`` for calibration inputs ``x`` ``[T, K]``."""
    n, k = weight.shape
    group = scheme.group_size or k
    groups = scheme.groups(k)
    w = weight.detach().to(torch.float64).clone()
    xd = x.to(torch.float64)
    hessian = 2 * xd.T @ xd / xd.shape[0]
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1
    w[:, dead] = 0
    hessian += DAMPING * torch.diagonal(hessian).mean() * torch.eye(k, dtype=torch.float64)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(hessian)), upper=True)
    block = group * max(1, _BLOCK // group) if group < k else _BLOCK
    integers = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, groups)
    zero_points = torch.zeros(n, groups)
    group_scheme = WeightOnlyScheme(scheme.bits, None, scheme.symmetric)
    if group == k:  # one scale per channel: from the whole (not yet updated) row, as GPTQ does
        first = quantize(w.float(), group_scheme)
        scales[:, 0], zero_points[:, 0] = first.scales[:, 0], first.zero_point_tensor()[:, 0].float()
    for start in range(0, k, block):
        end = min(start + block, k)
        w1 = w[:, start:end].clone()
        errors = torch.zeros_like(w1)
        inverse1 = inverse[start:end, start:end]
        for i in range(end - start):
            column = start + i
            g = column // group
            if group < k and column % group == 0:
                params = quantize(w1[:, i:i + group].float(), group_scheme)
                scales[:, g], zero_points[:, g] = params.scales[:, 0], params.zero_point_tensor()[:, 0].float()
            scale, zp = scales[:, g].double(), zero_points[:, g].double()
            q = torch.clamp(torch.round(w1[:, i] / scale + zp), 0, scheme.qmax)
            integers[:, column] = q.to(torch.uint8)
            error = (w1[:, i] - (q - zp) * scale) / inverse1[i, i]
            w1[:, i:] -= error[:, None] * inverse1[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ inverse[start:end, end:]
    stored_zero = None if scheme.symmetric else zero_points.to(torch.uint8)
    return QuantizedWeight(scheme, (n, k), pack(integers, scheme.bits), scales.contiguous(), stored_zero)

"""fbgemm-specific prepare pass: 7-bit inputs for depthwise convolutions.

FBGEMM's depthwise conv kernels multiply u8 activations by s8 weights with ``vpmaddubsw``, which
adds adjacent products into int16 *with saturation*, even on CPUs with VNNI (the dense GEMM paths
use ``vpdpbusd`` there; the depthwise ones do not). With 8-bit activations a pair can reach
2 * 255 * 128 = 65,280 and is clipped at 32,767: measured on this project's CI CPU (VNNI), 18% of a
depthwise conv's outputs were off by up to 43 quantization steps. With activations in [0, 127] a
pair stays within 32,512, and the outputs match the reference. So the values feeding depthwise
convs get 7-bit qparams, and every other activation keeps 8 bits (on CPUs without VNNI the core's
default qparams make the weights 7-bit instead, which keeps the dense GEMMs' pairs within int16).
Eager prepare runs this pass too, on each module's input observer. Qparams chosen without it (a
model quantized for another backend) are refused by the kernel when it is built (``kernels.py``).
"""

from __future__ import annotations

import torch
from torch import fx, nn

from qplug_core.plugin_api import PassResult, observed_inputs

REDUCED_QUANT_MAX = 127


def is_depthwise(module: nn.Module) -> bool:
    """Whether ``module`` (or the first module of a fused one) is a depthwise conv."""
    if isinstance(module, nn.Sequential) and len(module):
        module = module[0]
    groups = getattr(module, "groups", 1)
    return isinstance(groups, int) and groups > 1 and groups == getattr(module, "in_channels", None)


def _reduce(observer: nn.Module) -> bool:
    """Limit an 8-bit quint8 observer (or fake-quant and its observer) to [0, 127]."""
    targets = [observer, getattr(observer, "activation_post_process", None)]
    changed = False
    for target in filter(None, targets):
        if (getattr(target, "dtype", None) == torch.quint8 and target.quant_min == 0
                and target.quant_max > REDUCED_QUANT_MAX):
            target.quant_max = REDUCED_QUANT_MAX
            changed = True
    return changed


def limit_depthwise_input_range(gm: fx.GraphModule) -> PassResult:
    """fbgemm's depthwise kernels sum u8 x s8 pairs in int16, saturating on 8-bit inputs on any CPU.

    Gives every observed value that feeds a depthwise conv 7-bit qparams (see module docstring);
    the first line is the reason the core reports to a user whose own qconfig asked for more."""
    modified = False
    modules = dict(gm.named_modules(remove_duplicate=False))  # one walk, not a lookup per node
    for node in gm.graph.nodes:
        if node.op == "call_module" and is_depthwise(modules[node.target]):
            for observed in observed_inputs(gm, node):
                modified |= _reduce(observed.observer)
    return PassResult(gm, modified)

"""The plugin testing kit's pattern suite: a pattern config's generated model is quantized,
compiled into OpenVINO and compared with its reference form.

Each case costs an ONNX export and an OpenVINO compile (~2 s), so this runs a sample with one
case for each primitive the patterns map to in OpenVINO (convolutions of each rank and their
fusions, transposed conv, fully connected, eltwise, matmul, concat, activations, pooling,
interpolation, normalizations, shape ops, embedding; ``torch.bmm`` for ``aten.bmm``, which the
exporter translates apart from ``aten.matmul``: the other matmul spellings reach ONNX as one of the
two) instead of all 248;
``test_one_case_per_pattern_config`` still checks that every pattern config has a case. The whole
suite (``only = None``) was run once: 188 of 193 cases pass; the five failing are the clamps below.
"""

from __future__ import annotations

from qplug_core.plugin_api import BackendPatternSuite


class TestPatterns(BackendPatternSuite):
    backend = "openvino"
    distribution = "qplug-openvino"
    only = frozenset({
        "Conv1d", "Conv2d", "Conv3d", "ReLU <- BatchNorm2d <- Conv2d", "nni.ConvBnReLU2d",
        "ConvTranspose2d", "Linear", "ReLU <- Linear", "F.linear", "operator.add",
        "ReLU <- operator.add", "operator.mul", "torch.matmul", "torch.bmm", "torch.cat", "Hardswish", "SiLU",
        "Sigmoid", "Softmax", "LeakyReLU", "PReLU", "ReLU6", "torch.clamp", "AdaptiveAvgPool2d", "AvgPool2d",
        "MaxPool2d", "F.interpolate", "PixelShuffle", "torch.flatten", "torch.mean", ".permute()",
        ".reshape()", "BatchNorm2d", "InstanceNorm2d", "GroupNorm", "LayerNorm", "Embedding", "Hardtanh",
    })
    _CLAMP = ("a clamp between two int8 values (not after a conv, where qplug folds it into the "
              "output range) is requantized by OpenVINO one step away from the reference on ~17% of "
              "elements; the next conv makes it up to 3 steps")
    known_failures = {"torch.clamp": _CLAMP, "Hardtanh": _CLAMP}
    #: Softmax: not an openvino problem. torch.export gives ``aten.softmax.int``, which the
    #: export-level raise does not turn back into ``nn.Softmax``, and the shared pattern set has
    #: only the module form: the region is not planned on any backend at the export level (fbgemm's
    #: suite passes only because fbgemm has no softmax kernel, so both levels run the same kernels;
    #: onnxruntime has no pattern suite). PReLU was the same gap (``aten.prelu``), raised to
    #: ``nn.PReLU`` now. (F.linear on the case's buffer weight differed between the levels while
    #: symbolic capture kept it functional, its weight observed like an activation; it is a linear
    #: layer at both levels now.)
    known_export_failures = {
        "Softmax": "aten.softmax.int is not raised to nn.Softmax at the export level: no region"}

"""Port of PyTorch's ``TestFuseFx`` (``test/quantization/fx/test_quantize_fx.py``).

Translation: ``fuse_fx(m)`` (native backend config) -> ``qp.fuse_fx(m, backend="fbgemm")``;
``fuse_fx(m, backend_config=bc)`` -> ``qp.fuse_fx(m, backend=Backend(spec, bc))``;
``prepare_qat_fx(m, {}, example_inputs)`` -> ``qp.prepare_qat_fx(m, QConfigMapping(), ...)``;
``nni.*`` -> ``qplug_core.nn.intrinsic.*``; ``nniq.LinearReLU`` / ``nnq.Linear`` (lowered) -> the
report's ``quantized::linear`` kernels; ``_set_*`` private setters exist under the same names;
``checkGraphModuleNodes`` -> ``upstream_testkit.check_graph_module_nodes``.
"""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from upstream_testkit import (
    ConvBnAddReluModel,
    LinearBnLeakyReluModel,
    LinearReluLinearModel,
    LinearReluModel,
    LinearTanhModel,
    LinReluLin,
    ModelForConvTransposeBNFusion,
    call_module,
    check_graph_module_nodes,
    default_qconfig,
)

import qplug_core as qp
import qplug_core.nn.intrinsic as nni
from qplug_core.config import BackendConfig, BackendPatternConfig
from qplug_core.registry.backends import Backend, BackendSpec

pytestmark = pytest.mark.usefixtures("plugin_autoload")

ONEDNN_REASON = ("no qplug equivalent by design: qplug has no onednn backend config "
                 "(LinearLeakyReLU / LinearTanh / ConvAdd fusions are onednn-only upstream)")


def _backend(config: BackendConfig) -> Backend:
    return Backend(BackendSpec(config.name or "custom", "ported upstream test backend"), config)


class ConvBnReluAllDims(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1d, self.conv2d, self.conv3d = nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1)
        self.bn1d, self.bn2d, self.bn3d = nn.BatchNorm1d(1), nn.BatchNorm2d(1), nn.BatchNorm3d(1)
        self.conv1d2, self.conv2d2, self.conv3d2 = nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1)
        self.bn1d2, self.bn2d2, self.bn3d2 = nn.BatchNorm1d(1), nn.BatchNorm2d(1), nn.BatchNorm3d(1)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.conv1d(x)
        x = self.bn1d(x)
        x = self.conv2d(x)
        x = self.bn2d(x)
        x = self.conv3d(x)
        x = self.bn3d(x)
        x = self.conv1d2(x)
        x = self.bn1d2(x)
        x = self.relu(x)
        x = self.conv2d2(x)
        x = self.bn2d2(x)
        x = self.relu(x)
        x = self.conv3d2(x)
        x = self.bn3d2(x)
        x = self.relu(x)
        return x


TRAIN_MODE_FUSED = [call_module(nni.ConvBn1d), call_module(nni.ConvBn2d), call_module(nni.ConvBn3d),
                    call_module(nni.ConvBnReLU1d), call_module(nni.ConvBnReLU2d),
                    call_module(nni.ConvBnReLU3d)]


def test_fuse_conv_bn_relu():
    # train mode: prepare_qat_fx with an empty mapping fuses with is_qat=True and swaps nothing.
    # This model cannot run on any input (conv1d, then conv2d on the same tensor); prepare does
    # not run it because the mapping places no observer (issue 27: it raised InputMismatchError)
    m = ConvBnReluAllDims().train()
    m = qp.prepare_qat_fx(m, qp.QConfigMapping(), (torch.randn(1, 1, 1, 1),), backend="fbgemm")
    check_graph_module_nodes(m, expected_node_list=TRAIN_MODE_FUSED,
                             expected_node_occurrence={call_module(nn.ReLU): 0})
    assert m.training  # prepare_qat_fx returns the model in training mode
    # the same fusion step on its own
    m = qp.fuse_fx(ConvBnReluAllDims().train(), backend="fbgemm", is_qat=True)
    check_graph_module_nodes(m, expected_node_list=TRAIN_MODE_FUSED,
                             expected_node_occurrence={call_module(nn.ReLU): 0})
    # eval mode: fuse_fx folds BN
    m = qp.fuse_fx(ConvBnReluAllDims().eval(), backend="fbgemm")
    check_graph_module_nodes(
        m, expected_node_list=[call_module(nn.Conv1d), call_module(nn.Conv2d), call_module(nn.Conv3d),
                               call_module(nni.ConvReLU1d), call_module(nni.ConvReLU2d),
                               call_module(nni.ConvReLU3d)],
        expected_node_occurrence={call_module(nn.ReLU): 0})


def test_fuse_linear_bn_eval():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(1, 1)
            self.bn1d = nn.BatchNorm1d(1)

        def forward(self, x):
            return self.bn1d(self.linear(x))

    m = qp.fuse_fx(M().eval(), backend="fbgemm")
    check_graph_module_nodes(m, expected_node_list=[call_module(nn.Linear)],
                             expected_node_occurrence={call_module(nn.BatchNorm1d): 0})


@pytest.mark.skip(reason=ONEDNN_REASON)
def test_fuse_linear_bn_leaky_relu_onednn():
    """Upstream fuses linear-bn-leaky_relu with get_onednn_backend_config()."""


@pytest.mark.parametrize("with_bn", [True, False])
def test_linear_bn_leaky_relu_not_fused_by_default(with_bn):
    m = qp.fuse_fx(LinearBnLeakyReluModel(with_bn).eval(), backend="fbgemm")
    check_graph_module_nodes(m, expected_node_list=[call_module(nn.Linear), call_module(nn.LeakyReLU)],
                             expected_node_occurrence={call_module(nni.LinearLeakyReLU): 0})


@pytest.mark.skip(reason=ONEDNN_REASON)
def test_fuse_linear_tanh_for_onednn_backend():
    """Upstream fuses linear-tanh with get_onednn_backend_config()."""


def test_linear_tanh_not_fused_by_default():
    m = qp.fuse_fx(LinearTanhModel().eval(), backend="fbgemm")
    check_graph_module_nodes(m, expected_node_list=[call_module(nn.Linear), call_module(nn.Tanh)],
                             expected_node_occurrence={call_module(nni.LinearTanh): 0})


@pytest.mark.skip(reason=ONEDNN_REASON)
def test_fuse_conv_bn_add_relu_onednn():
    """Upstream fuses conv-bn-add-relu into ConvAdd(ReLU)2d with the onednn config."""


CONV_ADD_OPTIONS = list(itertools.product([True, False], repeat=5))


@pytest.mark.parametrize("with_bn, with_relu, left_conv, two_conv, use_torch_add", CONV_ADD_OPTIONS,
                         ids=["-".join(str(int(v)) for v in o) for o in CONV_ADD_OPTIONS])
def test_fuse_conv_bn_add_relu_by_default(with_bn, with_relu, left_conv, two_conv, use_torch_add):
    m = ConvBnAddReluModel(with_bn=with_bn, with_relu=with_relu, left_conv=left_conv,
                           two_conv=two_conv, use_torch_add=use_torch_add).eval()
    m = qp.fuse_fx(m, backend="fbgemm")
    check_graph_module_nodes(m, expected_node_list=[call_module(nn.Conv2d)],
                             expected_node_occurrence={call_module(nni.ConvAdd2d): 0})


@pytest.mark.skip(reason=ONEDNN_REASON)
def test_fuse_conv_bn_add_relu_lowering():
    """Upstream lowers ConvAdd(ReLU)2d to nniq modules under the onednn engine."""


def test_fuse_convtranspose_bn_eval():
    m = qp.fuse_fx(ModelForConvTransposeBNFusion().eval(), backend="fbgemm")
    check_graph_module_nodes(
        m, expected_node_list=[call_module(nn.ConvTranspose1d), call_module(nn.ConvTranspose2d),
                               call_module(nn.ConvTranspose3d)],
        expected_node_occurrence={call_module(nn.BatchNorm1d): 0, call_module(nn.BatchNorm2d): 0,
                                  call_module(nn.BatchNorm3d): 0})


def test_fuse_module_relu():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1d, self.conv2d, self.conv3d = nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1)
            self.bn1d, self.bn2d, self.bn3d = nn.BatchNorm1d(1), nn.BatchNorm2d(1), nn.BatchNorm3d(1)
            self.relu = nn.ReLU()

        def forward(self, x):
            x = self.relu(self.conv1d(x))
            x = self.relu(self.conv2d(x))
            x = self.relu(self.conv3d(x))
            x = self.relu(self.bn1d(x))
            x = self.relu(self.bn2d(x))
            x = self.relu(self.bn3d(x))
            return x

    m = qp.fuse_fx(M().eval(), backend="fbgemm")
    check_graph_module_nodes(
        m, expected_node_list=[call_module(nni.ConvReLU1d), call_module(nni.ConvReLU2d),
                               call_module(nni.ConvReLU3d), call_module(nni.BNReLU2d),
                               call_module(nni.BNReLU3d)])


@pytest.mark.parametrize("model, kernels", [
    (LinearReluModel, ["quantized::linear"]),
    (LinearReluLinearModel, ["quantized::linear", "quantized::linear"]),
], ids=["LinearReluModel", "LinearReluLinearModel"])
def test_qconfig_fused_module(model, kernels):
    qconfig_mapping = (qp.QConfigMapping().set_global(None)
                       .set_object_type(nn.Linear, default_qconfig())
                       .set_object_type(nn.ReLU, default_qconfig())
                       .set_object_type(F.relu, default_qconfig()))
    m = model().eval()
    example_inputs = (torch.rand(5, 5),)
    prepared = qp.prepare_fx(m, qconfig_mapping, example_inputs, backend="fbgemm")
    prepared(*example_inputs)
    quantized = qp.convert_fx(prepared)
    # upstream: quantize_per_tensor -> nniq.LinearReLU (-> nnq.Linear) -> dequantize
    report = qp.quantization_report(quantized)
    assert list(report.kernels.values()) == kernels
    assert report.fusions[0].fused_type == "LinearReLU"
    check_graph_module_nodes(quantized, expected_node_occurrence={call_module(nn.ReLU): 0})


def test_problematic_fuse_example():
    fbgemm = qp.get_default_qconfig_mapping("fbgemm").qconfig_for_module("x", nn.Linear)
    qconfig_mapping = (qp.QConfigMapping().set_global(None)
                       .set_object_type(nn.Linear, fbgemm).set_object_type(nn.ReLU, fbgemm))
    m = qp.prepare_fx(LinReluLin().eval(), qconfig_mapping, (torch.randn(1, 5),), backend="fbgemm")
    check_graph_module_nodes(m, expected_node=call_module(nni.LinearReLU))


class MyConvReLU(nn.Module):
    def __init__(self, conv=None):
        super().__init__()
        self.conv = conv

    def forward(self, x):
        return torch.relu(self.conv(x))


def test_fuse_addtional_fuser_method():
    """Upstream skips it ("until the simple pattern format is supported"); qplug supports it: an
    extra fuser method is a BackendPatternConfig with that fuser."""
    def my_conv_relu_fuser(is_qat, conv, relu):
        return MyConvReLU(conv)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3)
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.conv(x))

    config = BackendConfig("extra").set_backend_pattern_config(
        BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(my_conv_relu_fuser))
    m = qp.fuse_fx(M().eval(), backend=_backend(config))
    check_graph_module_nodes(m, expected_node=call_module(MyConvReLU))


@pytest.mark.parametrize("use_torch_add", [True, False])
def test_fuse_custom_pattern(use_torch_add):
    class M(nn.Module):
        def __init__(self, use_torch_add=True):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3)
            self.bn = nn.BatchNorm2d(3)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3)
            self.add = torch.add if use_torch_add else operator.add

        def forward(self, x):
            y = x
            y = self.maxpool(x)
            x = self.conv(x)
            x = self.bn(x)
            x = self.add(y, x)
            x = self.relu(x)
            return x

    m = M(use_torch_add).eval()

    def fuse_conv_bn_relu(is_qat, relu, add_pattern):
        _, _, bn_pattern = add_pattern
        bn, conv = bn_pattern
        return conv

    config1 = BackendPatternConfig()._set_pattern_complex_format(
        (nn.ReLU, (torch.add, qp.MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))).set_fuser_method(fuse_conv_bn_relu)
    config2 = BackendPatternConfig()._set_pattern_complex_format(
        (nn.ReLU, (operator.add, qp.MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))).set_fuser_method(fuse_conv_bn_relu)
    backend_config = BackendConfig("custom").set_backend_pattern_config(config1) \
        .set_backend_pattern_config(config2)
    m = qp.fuse_fx(m, backend=_backend(backend_config))
    assert type(m.conv) is nn.Conv2d
    # bn and relu are gone since the whole pattern was replaced by conv
    assert not hasattr(m, "bn")
    assert not hasattr(m, "relu")


def test_fusion_pattern_with_multiple_inputs():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3)
            self.bn = nn.BatchNorm2d(3)
            self.relu = nn.ReLU()
            self.maxpool = nn.MaxPool2d(3)

        def forward(self, x):
            y = x
            y = self.maxpool(x)
            x = self.conv(x)
            x = self.bn(x)
            x = torch.add(x, y)
            x = self.relu(x)
            return x

    m = M().eval()

    def fuse_conv_bn_relu(is_qat, relu, add_pattern):
        _, bn_pattern, _ = add_pattern
        bn, conv = bn_pattern
        return conv

    def conv_bn_res_relu_root_node_getter(pattern):
        relu, add_pattern = pattern
        _, bn_pattern, _ = add_pattern
        bn, conv = bn_pattern
        return conv

    def conv_bn_res_relu_extra_inputs_getter(pattern):
        relu, add_pattern = pattern
        _, bn_pattern, extra_input = add_pattern
        return [extra_input]

    config = BackendPatternConfig()._set_pattern_complex_format(
        (nn.ReLU, (torch.add, (nn.BatchNorm2d, nn.Conv2d), qp.MatchAllNode))) \
        .set_fuser_method(fuse_conv_bn_relu) \
        ._set_root_node_getter(conv_bn_res_relu_root_node_getter) \
        ._set_extra_inputs_getter(conv_bn_res_relu_extra_inputs_getter)
    m = qp.fuse_fx(m, backend=_backend(BackendConfig("custom").set_backend_pattern_config(config)))
    assert type(m.conv) is nn.Conv2d
    assert not hasattr(m, "bn")
    assert not hasattr(m, "relu")
    named_modules = dict(m.named_modules())
    for node in m.graph.nodes:
        if node.op == "call_module" and type(named_modules[node.target]) is nn.Conv2d:
            assert len(node.args) == 2, "Expecting the fused op to have two arguments"


def test_fusion_pattern_with_matchallnode():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(3, 3, 3)
            self.relu1 = nn.ReLU()
            self.conv2 = nn.Conv2d(3, 3, 3)
            self.relu2 = nn.ReLU()

        def forward(self, x):
            y = self.conv1(x)
            y = self.relu1(y)
            x = self.conv2(x)
            x = torch.add(x, y)
            x = self.relu2(x)
            return x

    m = M().eval()

    def fuse_conv_relu(is_qat, conv, relu):
        return conv

    def fuse_conv_res_relu(is_qat, relu, add_pattern):
        _, conv, _ = add_pattern
        return conv

    def conv_res_relu_root_node_getter(pattern):
        relu, (_, conv, _) = pattern
        return conv

    def conv_res_relu_extra_inputs_getter(pattern):
        relu, (_, _, extra_input) = pattern
        return [extra_input]

    conv_relu_config = BackendPatternConfig((nn.Conv2d, nn.ReLU)).set_fuser_method(fuse_conv_relu)
    conv_res_relu_config = BackendPatternConfig()._set_pattern_complex_format(
        (nn.ReLU, (torch.add, nn.Conv2d, qp.MatchAllNode))) \
        .set_fuser_method(fuse_conv_res_relu) \
        ._set_root_node_getter(conv_res_relu_root_node_getter) \
        ._set_extra_inputs_getter(conv_res_relu_extra_inputs_getter)
    backend_config = BackendConfig("custom").set_backend_pattern_config(conv_relu_config) \
        .set_backend_pattern_config(conv_res_relu_config)
    m = qp.fuse_fx(m, backend=_backend(backend_config))
    assert type(m.conv1) is nn.Conv2d
    assert type(m.conv2) is nn.Conv2d
    # relus are gone since both patterns were replaced by conv
    assert not hasattr(m, "relu1")
    assert not hasattr(m, "relu2")

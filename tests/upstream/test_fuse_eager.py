"""Port of PyTorch's ``test/quantization/eager/test_fuse_eager.py`` (TestFuseEager).

Translation: ``fuse_modules`` / ``prepare`` / ``prepare_qat`` / ``convert`` -> ``qp.eager.*`` with
``backend=``; ``override_quantized_engine(qengine)`` over ``supported_qengines`` -> a parametrized
``backend`` (fbgemm, qnnpack); ``nni.*`` / ``nniqat.*`` -> ``qplug_core.nn.intrinsic`` /
``qplug_core.nn.qat``; the quantized ``nniq.ConvReLU2d`` / ``nnq.Conv2d`` / ``nniq.LinearReLU`` /
``nniq.BNReLU3d`` -> qplug's kernel modules (``K.Conv2d`` running ``quantized::conv2d_relu`` ...);
``default_qconfig`` / ``default_qat_qconfig`` / ``get_default_qconfig(engine)`` -> the backend's
default mapping's qconfig for the module.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from upstream_testkit import (
    ModelForFusion,
    ModelForFusionWithBias,
    ModelForLinearBNFusion,
    ModelWithSequentialFusion,
    check_no_qconfig,
    eval_fn,
    img_data_1d,
    img_data_2d,
)

import qplug_core as qp
import qplug_core.nn.intrinsic as nni
import qplug_core.nn.qat as nniqat
from qplug_core.errors import ModelStateError
from qplug_core.kernels import torch_int8 as K

pytestmark = pytest.mark.usefixtures("plugin_autoload")
_Q = torch.ops.quantized


def qconfig(backend: str = "fbgemm", mode: str = "static") -> qp.QConfig:
    return qp.get_default_qconfig_mapping(backend, mode).qconfig_for_module("m", nn.Conv2d)


def _is_kernel(module, cls, op) -> bool:
    return type(module) is cls and module._op is op


def test_fuse_module_train():
    model = ModelForFusion(qconfig(mode="qat")).train()
    # step by step fusion
    model = qp.eager.fuse_modules_qat(model, ["conv1", "bn1", "relu1"])  # upstream: fuse_modules(train model)
    model = qp.eager.fuse_modules_qat(model, ["sub1.conv", "sub1.bn"])
    assert type(model.conv1) is nni.ConvBnReLU2d
    assert type(model.bn1) is nn.Identity and type(model.relu1) is nn.Identity
    assert type(model.sub1.conv) is nni.ConvBn2d and type(model.sub1.bn) is nn.Identity
    assert type(model.sub2.conv) is nn.Conv2d and type(model.sub2.relu) is nn.ReLU
    model = qp.eager.prepare_qat(model, backend="fbgemm")
    assert type(model.conv1) is nniqat.ConvBnReLU2d
    assert type(model.bn1) is nn.Identity and type(model.relu1) is nn.Identity
    assert type(model.sub1.conv) is nniqat.ConvBn2d and type(model.sub1.bn) is nn.Identity
    assert type(model.sub2.conv) is nn.Conv2d and type(model.sub2.relu) is nn.ReLU
    # upstream trains with test_only_train_fn; ModelForFusion's output has 10 classes
    optimizer = torch.optim.Adam(model.parameters(), lr=0.001)
    for (x,) in img_data_1d():
        loss = model(x).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    # upstream then expects the converted model to fail: the unfused bn3 sits between int8 layers,
    # and eager mode cannot see that (no graph); upstream fails in torch ("Could not run
    # 'aten::native_batch_norm' with arguments from the 'QuantizedCPU' backend"), qplug names it
    converted = qp.eager.convert(model.eval())
    with pytest.raises(ModelStateError, match=r"module 'bn3' \(BatchNorm1d\) stayed float after "
                                              "qp.eager.convert"):
        eval_fn(converted, img_data_1d())


def _fuse_eval(model):
    return qp.eager.fuse_modules(model, [["conv3", "bn3", "relu4"], ["conv1", "bn1", "relu1"],
                                         ["conv2", "relu2"], ["bn2", "relu3"], ["sub1.conv", "sub1.bn"]])


def test_fuse_module_eval():
    model = _fuse_eval(ModelForFusion(qconfig()).eval())
    assert type(model.conv1) is nni.ConvReLU2d
    assert type(model.conv1[0]) is nn.Conv2d and type(model.conv1[1]) is nn.ReLU
    assert type(model.bn1) is nn.Identity and type(model.relu1) is nn.Identity
    assert type(model.conv2) is nni.ConvReLU3d
    assert type(model.bn2) is nni.BNReLU3d and type(model.relu3) is nn.Identity
    assert type(model.conv2[0]) is nn.Conv3d and type(model.conv2[1]) is nn.ReLU
    assert type(model.relu2) is nn.Identity
    assert type(model.conv3) is nni.ConvReLU1d
    assert type(model.conv3[0]) is nn.Conv1d and type(model.conv3[1]) is nn.ReLU
    assert type(model.bn3) is nn.Identity
    assert type(model.sub1.conv) is nn.Conv2d and type(model.sub1.bn) is nn.Identity
    assert type(model.sub2.conv) is nn.Conv2d and type(model.sub2.relu) is nn.ReLU
    model = qp.eager.prepare(model, backend="fbgemm")
    eval_fn(model, img_data_1d())
    model = qp.eager.convert(model)

    assert _is_kernel(model.conv3, K.Conv1d, _Q.conv1d_relu)  # nniq.ConvReLU1d
    assert _is_kernel(model.conv1, K.Conv2d, _Q.conv2d_relu)  # nniq.ConvReLU2d
    assert type(model.bn1) is nn.Identity and type(model.relu1) is nn.Identity
    assert _is_kernel(model.sub1.conv, K.Conv2d, _Q.conv2d)  # nnq.Conv2d
    assert type(model.sub1.bn) is nn.Identity
    assert type(model.sub2.conv) is nn.Conv2d and type(model.sub2.relu) is nn.ReLU
    assert type(model.bn2) is K.BatchNorm3d  # nniq.BNReLU3d
    eval_fn(model, img_data_1d())
    # upstream's checkNoQconfig: torch.ao's convert removes every qconfig attribute
    check_no_qconfig(model)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_fusion_sequential_model_train(backend):
    model = ModelWithSequentialFusion().train()
    groups = [["conv1", "relu1"], ["features.0.0", "features.0.1", "features.0.2"],
              ["features.1.0", "features.1.1", "features.1.2"],
              ["features.2.0", "features.2.1", "features.2.2"], ["classifier.0", "classifier.1"]]
    qp.eager.fuse_modules_qat(model, groups, inplace=True)
    assert type(model.conv1) is nni.ConvReLU2d
    assert type(model.conv1[0]) is nn.Conv2d and type(model.conv1[1]) is nn.ReLU
    assert type(model.relu1) is nn.Identity
    for i in range(3):
        assert type(model.features[i][0]) is nni.ConvBnReLU2d
        assert type(model.features[i][1]) is nn.Identity and type(model.features[i][2]) is nn.Identity
    assert type(model.classifier[0]) is nni.LinearReLU and type(model.classifier[1]) is nn.Identity
    model.qconfig = qconfig(backend, "qat")
    model = qp.eager.prepare_qat(model, backend=backend)
    model(img_data_2d()[0][0])
    assert type(model.conv1) is nniqat.ConvReLU2d and type(model.relu1) is nn.Identity
    for i in range(3):
        assert type(model.features[i][0]) is nniqat.ConvBnReLU2d
    assert type(model.classifier[0]) is nniqat.LinearReLU and type(model.classifier[1]) is nn.Identity
    model(img_data_2d()[1][0])
    model = qp.eager.convert(model.eval())
    model(img_data_2d()[1][0])
    _check_sequential_quantized(model)


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_fusion_sequential_model_eval(backend):
    model = ModelWithSequentialFusion().eval()
    groups = [["conv1", "relu1"], ["features.0.0", "features.0.1", "features.0.2"],
              ["features.1.0", "features.1.1", "features.1.2"],
              ["features.2.0", "features.2.1", "features.2.2"], ["classifier.0", "classifier.1"]]
    qp.eager.fuse_modules(model, groups, inplace=True)
    assert type(model.conv1) is nni.ConvReLU2d
    assert type(model.conv1[0]) is nn.Conv2d and type(model.conv1[1]) is nn.ReLU
    assert type(model.relu1) is nn.Identity
    for i in range(3):
        assert type(model.features[i][0]) is nni.ConvReLU2d
        assert type(model.features[i][1]) is nn.Identity and type(model.features[i][2]) is nn.Identity
    assert type(model.classifier[0]) is nni.LinearReLU and type(model.classifier[1]) is nn.Identity
    model.qconfig = qconfig(backend)
    model = qp.eager.prepare(model, backend=backend)
    model(img_data_2d()[0][0])
    model = qp.eager.convert(model)
    model(img_data_2d()[1][0])
    _check_sequential_quantized(model)


def _check_sequential_quantized(model):
    """checkModelWithSequentialQuantized: nniq.ConvReLU2d x4, nniq.LinearReLU."""
    assert _is_kernel(model.conv1, K.Conv2d, _Q.conv2d_relu)
    assert type(model.relu1) is nn.Identity
    for i in range(3):
        assert _is_kernel(model.features[i][0], K.Conv2d, _Q.conv2d_relu)
        assert type(model.features[i][1]) is nn.Identity and type(model.features[i][2]) is nn.Identity
    assert _is_kernel(model.classifier[0], K.Linear, _Q.linear_relu)
    assert type(model.classifier[1]) is nn.Identity


@pytest.mark.parametrize("backend", ["fbgemm", "qnnpack"])
def test_fusion_conv_with_bias(backend):
    torch.manual_seed(0)
    model_orig = ModelForFusionWithBias().train()
    model_ref = copy.deepcopy(model_orig)
    x = img_data_2d()[0][0]
    out_ref = model_ref(x)  # output with no fusion
    # upstream: qconfig QConfig(activation=nn.Identity, weight=nn.Identity) + prepare_qat gives
    # the fused QAT model without observers; qplug's QConfig takes observers only, so the
    # observer-free QAT model is fuse_modules_qat's output itself (ConvBnReLU2d in train mode)
    model = qp.eager.fuse_modules_qat(model_orig, [["conv1", "bn1", "relu1"], ["conv2", "bn2"]])
    prep_model = copy.deepcopy(model)
    out_fused = prep_model(x)
    torch.testing.assert_close(out_ref, out_fused)

    def check_bn(bn_ref, bn):
        torch.testing.assert_close(bn_ref.weight, bn.weight)
        torch.testing.assert_close(bn_ref.bias, bn.bias)
        torch.testing.assert_close(bn_ref.running_mean, bn.running_mean)
        torch.testing.assert_close(bn_ref.running_var, bn.running_var)

    check_bn(model_ref.bn1, prep_model.conv1[1])
    check_bn(model_ref.bn2, prep_model.conv2[1])
    model.qconfig = qconfig(backend, "qat")
    model = qp.eager.prepare_qat(model, backend=backend)
    model(x)
    assert type(model.conv1) is nniqat.ConvBnReLU2d
    assert type(model.bn1) is nn.Identity and type(model.relu1) is nn.Identity
    assert type(model.conv2) is nniqat.ConvBn2d and type(model.bn2) is nn.Identity


def test_fusion_linear_bn_eval():
    model = ModelForLinearBNFusion().train()
    inp1, inp2 = torch.randn(8, 20), torch.randn(8, 20)
    model(inp1)  # get some interesting values into the running mean and variance
    model.eval()
    golden = model(inp2)
    model = qp.eager.fuse_modules(model, [["fc", "bn"]])
    assert type(model.bn) is nn.Identity
    torch.testing.assert_close(golden, model(inp2))


def test_forward_hooks_preserved():
    model = ModelForFusion(qconfig(mode="qat")).train()
    counter = {"pre_forwards": 0, "forwards": 0}
    fused = False

    def fw_pre_hook(fused_module_class, h_module, input):
        if fused:
            assert type(h_module) is fused_module_class, \
                "After fusion owner of the first module's forward pre hook is not a fused module"
        counter["pre_forwards"] += 1

    def fw_hook(fused_module_class, h_module, input, output):
        if fused:
            assert type(h_module) is fused_module_class, \
                "After fusion owner of the last module's forward hook is not a fused module"
        counter["forwards"] += 1

    # two pre and two post forward hooks: the counters grow by two per inference
    model.conv1.register_forward_pre_hook(lambda *args: fw_pre_hook(nni.ConvBnReLU2d, *args))
    model.sub1.conv.register_forward_pre_hook(lambda *args: fw_pre_hook(nni.ConvBn2d, *args))
    model.relu1.register_forward_hook(lambda *args: fw_hook(nni.ConvBnReLU2d, *args))
    model.sub1.bn.register_forward_hook(lambda *args: fw_hook(nni.ConvBn2d, *args))
    data = img_data_1d()
    eval_fn(model, data)
    assert counter["pre_forwards"] == 2 * len(data)
    assert counter["forwards"] == 2 * len(data)

    model = qp.eager.fuse_modules_qat(model, ["conv1", "bn1", "relu1"])
    model = qp.eager.fuse_modules_qat(model, ["sub1.conv", "sub1.bn"])
    fused = True
    before_pre, before_post = counter["pre_forwards"], counter["forwards"]
    eval_fn(model, data)
    assert counter["pre_forwards"] - before_pre == 2 * len(data)
    assert counter["forwards"] - before_post == 2 * len(data)

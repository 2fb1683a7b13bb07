"""Eager fuse_modules: fused module types, numerics of eval fusion, and error cases."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigError, ConfigValidationError, PatternError
from qplug_core.nn import intrinsic as nni


def _toy(training: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(OrderedDict(
        c1=nn.Conv1d(2, 4, 3), b1=nn.BatchNorm1d(4), r1=nn.ReLU(),
        blk=nn.Sequential(OrderedDict(c2=nn.Conv2d(2, 4, 3), b2=nn.BatchNorm2d(4), r2=nn.ReLU())),
        c3=nn.Conv3d(2, 4, 1), b3=nn.BatchNorm3d(4), r3=nn.ReLU(),
        c4=nn.Conv2d(2, 4, 1), r4=nn.ReLU(), b5=nn.BatchNorm2d(4), r5=nn.ReLU(),
        l1=nn.Linear(4, 4), lb=nn.BatchNorm1d(4), l2=nn.Linear(4, 4), lr=nn.ReLU()))
    for bn in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return model.train(training)


GROUPS = [["c1", "b1", "r1"], ["blk.c2", "blk.b2", "blk.r2"], ["c3", "b3", "r3"], ["c4", "r4"],
          ["b5", "r5"], ["l1", "lb"], ["l2", "lr"]]
EVAL_TYPES = {"c1": nni.ConvReLU1d, "blk.c2": nni.ConvReLU2d, "c3": nni.ConvReLU3d,
              "c4": nni.ConvReLU2d, "b5": nni.BNReLU2d, "l1": nn.Linear, "l2": nni.LinearReLU}
QAT_TYPES = {"c1": nni.ConvBnReLU1d, "blk.c2": nni.ConvBnReLU2d, "c3": nni.ConvBnReLU3d,
             "c4": nni.ConvReLU2d, "b5": nni.BNReLU2d, "l1": nni.LinearBn1d, "l2": nni.LinearReLU}


@pytest.mark.parametrize("is_qat, expected", [(False, EVAL_TYPES), (True, QAT_TYPES)])
def test_fused_types_are_exact_and_others_become_identity(is_qat, expected):
    model = _toy(training=is_qat)
    fused = qp.eager.fuse_modules(model, GROUPS, is_qat=is_qat)
    modules = dict(fused.named_modules())
    assert {name: type(modules[name]) for name in expected} == expected
    for group in GROUPS:
        assert all(type(modules[name]) is nn.Identity for name in group[1:])
    assert type(model.c1) is nn.Conv1d and type(model.b1) is nn.BatchNorm1d  # user model unchanged


def test_eval_fusion_computes_what_the_unfused_modules_compute():
    model = _toy()
    fused = qp.eager.fuse_modules(model, [["c4", "r4"], ["b5", "r5"], ["blk.c2", "blk.b2", "blk.r2"]])
    x = torch.randn(2, 2, 6, 6)
    with torch.no_grad():
        assert torch.allclose(fused.blk(x), model.blk(x), atol=1e-5)
        assert torch.allclose(fused.r5(fused.b5(fused.r4(fused.c4(x)))),
                              model.r5(model.b5(model.r4(model.c4(x)))), atol=1e-5)


def test_single_group_inplace_and_fuse_modules_qat():
    model = _toy(training=True)
    same = qp.eager.fuse_modules_qat(model, ["l1", "lb"], inplace=True)
    assert same is model and type(model.l1) is nni.LinearBn1d and type(model.lb) is nn.Identity


def test_unknown_name_says_did_you_mean():
    with pytest.raises(ConfigError, match=r"no submodule 'blk\.conv2'.*did you mean 'blk\.c2'"):
        qp.eager.fuse_modules(_toy(), [["blk.conv2", "blk.b2"]])


def test_unsupported_type_sequence_is_a_pattern_error():
    with pytest.raises(PatternError, match=r"cannot fuse \['r1', 'c1'\].*No fuser method for \(ReLU, Conv1d\)"):
        qp.eager.fuse_modules(_toy(), [["r1", "c1"]])


def test_eval_fusion_of_a_training_batchnorm_is_refused_naming_the_qat_fusion():
    """The message named prepare_qat, which does not fuse; fuse_modules_qat keeps BN trainable."""
    with pytest.raises(ConfigValidationError, match=r"cannot fuse \['l1', 'lb'\].*needs eval-mode.*"
                                                    r"qp.eager.fuse_modules_qat in eager mode"):
        qp.eager.fuse_modules(_toy(training=True), [["l1", "lb"]])
    assert isinstance(qp.eager.fuse_modules_qat(_toy(training=True), [["l1", "lb"]]).l1, nni.LinearBn1d)


@pytest.mark.parametrize("bad", ["c1", [["c1"]], [["c1", 3]]])
def test_malformed_groups_are_rejected(bad):
    with pytest.raises(ConfigValidationError, match="modules_to_fuse"):
        qp.eager.fuse_modules(_toy(), bad)

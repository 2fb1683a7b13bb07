"""qp.compare pairs each int8 layer with the float ops it computes.

An unfused float model's conv was paired with the int8 conv-bn(-relu) (rows of -3..2 dB for 34-44
dB layers, no warning); and on fbgemm a conv-bn before ReLU6 before a depthwise conv, whose 7-bit
int8 output already clips at 0, was compared with the unclamped float conv (3 dB for 39 dB).
Each row is checked against the SQNR computed here in float64 from the same modules.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import qplug_core as qp

pytestmark = pytest.mark.usefixtures("one_thread", "plugin_autoload")


class Net(nn.Module):
    """conv-bn-relu -> 1x1 conv-bn -> ReLU6 -> depthwise conv -> linear (MobileNetV2's pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pw, self.pw_bn, self.act = nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU6()
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = nn.Linear(16 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        return self.fc(self.dw(self.act(self.pw_bn(self.pw(x)))).flatten(1))

    def references(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What each int8 layer computes, in float64."""
        net = copy.deepcopy(self).double().requires_grad_(False)
        conv = torch.relu(net.bn(net.conv(x.double())))
        pw = torch.clamp(net.pw_bn(net.pw(conv)), 0, 6)
        return {"conv": conv, "pw": pw}


def _sqnr64(reference: torch.Tensor, test: torch.Tensor) -> float:
    err = reference - test.double()
    return 10 * math.log10(float(reference.square().sum()) / float(err.square().sum()))


def _int8_outputs(qmodel: nn.Module, x: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
    modules, outputs = dict(qmodel.named_modules()), {}
    handles = [modules[n].register_forward_hook(
        lambda m, a, out, n=n: outputs.__setitem__(n, out.dequantize() if out.is_quantized else out))
        for n in names]
    with torch.no_grad():
        qmodel(x)
    for handle in handles:
        handle.remove()
    return outputs


@pytest.fixture(scope="module")
def quantized() -> tuple[Net, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().eval()
    for bn in (model.bn, model.pw_bn):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.bias.data.uniform_(-0.5, 0.5)
    # ReLU6's input reaching ~5: 7-bit 0..127 covers it, 8-bit 0..255 of that scale would not
    # cover only 0..6, so convert keeps the ReLU6 (the case that read 3 dB)
    model.pw_bn.weight.data.fill_(2.5)
    calibration = [(torch.randn(8, 3, 4, 4),) for _ in range(4)]
    qmodel = qp.quantize(model, calibration[0], calibration, backend="fbgemm")
    return model, qmodel, torch.randn(16, 3, 4, 4)


def test_unfused_float_model_is_fused_like_the_quantized_one_and_rows_match_float64(quantized):
    model, qmodel, x = quantized
    with pytest.warns(UserWarning, match=r"qp\.fuse_fx\(float_model, backend='fbgemm'\)"):
        report = qp.compare(model, qmodel, (x,))
    rows = {layer.name: layer for layer in report.layers}
    int8 = _int8_outputs(qmodel, x, ["conv", "pw"])
    for name, reference in model.references(x).items():
        assert rows[name].sqnr_db == pytest.approx(_sqnr64(reference, int8[name]), abs=1e-3), name
        assert rows[name].sqnr_db > 30, name


def test_fused_float_model_gives_the_same_rows_without_a_warning(quantized, recwarn):
    model, qmodel, x = quantized
    fused = qp.fuse_fx(model, (x,), backend="fbgemm")
    report = qp.compare(fused, qmodel, (x,))
    assert not [w for w in recwarn if "fuse_fx" in str(w.message)]
    rows = {layer.name: layer for layer in report.layers}
    assert "act" in dict(qmodel.named_modules())  # the ReLU6 was kept
    assert rows["pw"].float_type == "Conv2d+ReLU6"
    int8 = _int8_outputs(qmodel, x, ["pw"])
    assert rows["pw"].sqnr_db == pytest.approx(_sqnr64(model.references(x)["pw"], int8["pw"]), abs=1e-3)


class AffineNet(nn.Module):
    """conv -> per-channel mul/add (a frozen BatchNorm as export captures it) -> fc1 -> ReLU -> fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.scale = nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(1, 8, 1, 1))
        self.fc1, self.act, self.fc2 = nn.Linear(8 * 16, 32), nn.ReLU(), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1((self.conv(x) * self.scale + self.shift).flatten(1))))

    def references(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """What each int8 layer computes, in float64."""
        net = copy.deepcopy(self).double().requires_grad_(False)
        conv = net.conv(x.double()) * net.scale + net.shift
        return {"conv": conv, "fc1": torch.relu(net.fc1(conv.flatten(1)))}


@pytest.fixture(scope="module")
def affine_net() -> tuple[AffineNet, list[tuple[torch.Tensor]], torch.Tensor]:
    torch.manual_seed(0)
    return AffineNet().eval(), [(torch.randn(8, 3, 4, 4),) for _ in range(4)], torch.randn(16, 3, 4, 4)


@pytest.fixture(scope="module")
def exported(affine_net) -> nn.Module:
    model, calibration, _ = affine_net
    return qp.quantize(model, calibration[0], calibration, backend="fbgemm", capture="export")


def test_export_rows_cover_the_fused_relu_and_the_folded_affine(affine_net, exported, recwarn):
    # before: the bare float conv and fc1 were paired with int8 layers computing conv*scale+shift and
    # relu(fc1): -6.4 dB and 2.6 dB, and the ReLU module was listed as absent from the int8 model
    model, calibration, x = affine_net
    qmodel = exported
    report = qp.compare(model, qmodel, (x,))
    assert not [w for w in recwarn if "fuse_fx" in str(w.message)]
    rows = {layer.name: layer for layer in report.layers}
    assert (rows["conv"].float_type, rows["fc1"].float_type) == ("Conv2d+affine", "Linear+ReLU")
    int8 = _int8_outputs(qmodel, x, ["conv", "fc1"])
    for name, reference in model.references(x).items():
        assert rows[name].sqnr_db == pytest.approx(_sqnr64(reference, int8[name]), abs=1e-3), name
        assert rows[name].sqnr_db > 30, name
    assert "act" not in report.float_only


def test_symbolic_rows_pair_the_fused_float_model_without_applying_the_relu_twice(affine_net):
    model, calibration, x = affine_net
    qmodel = qp.quantize(model, calibration[0], calibration, backend="fbgemm", capture="symbolic")
    with pytest.warns(UserWarning, match=r"qp\.fuse_fx\(float_model, backend='fbgemm'\)"):
        report = qp.compare(model, qmodel, (x,))
    rows = {layer.name: layer for layer in report.layers}
    assert rows["fc1"].float_type == "LinearReLU"  # the fused float module, no follower added
    int8 = _int8_outputs(qmodel, x, ["fc1"])
    assert rows["fc1"].sqnr_db == pytest.approx(_sqnr64(model.references(x)["fc1"], int8["fc1"]), abs=1e-3)
    assert report.float_only == []


class BnThenAffine(nn.Module):
    """conv-bn-relu (compare fuses the float model) -> conv * scale + shift (folded in both)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.scale = nn.Parameter(torch.rand(1, 8, 1, 1) + 0.5)
        self.shift = nn.Parameter(torch.randn(1, 8, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.bn1(self.conv1(x)))) * self.scale + self.shift


def test_export_affine_is_not_applied_again_to_a_float_model_compare_fused():
    torch.manual_seed(0)
    model, x = BnThenAffine().eval(), torch.randn(8, 3, 4, 4)
    qmodel = qp.quantize(model, (x,), [(x,)], backend="fbgemm", capture="export")
    with pytest.warns(UserWarning, match=r"qp\.fuse_fx\(float_model, backend='fbgemm'\)"):
        report = qp.compare(model, qmodel, (x,))
    rows = {layer.name: layer for layer in report.layers}
    with torch.no_grad():
        reference = model.conv2(torch.relu(model.bn1(model.conv1(x)))) * model.scale + model.shift
    assert rows["conv2"].sqnr_db == pytest.approx(
        _sqnr64(reference.double(), _int8_outputs(qmodel, x, ["conv2"])["conv2"]), abs=0.05)
    assert rows["conv2"].sqnr_db > 30


def test_fusion_records_survive_preparing_a_fused_graph_again(affine_net):
    # qp.quantize's SmoothQuant prepares the fused graph a second time: the records were replaced by
    # the second pass's empty list, and DETR's LinearReLU rows read 2.6 dB against the bare Linear
    model, calibration, x = affine_net
    fused = qp.fuse_fx(model, calibration[0], backend="fbgemm", capture="export")
    observed = qp.prepare_fx(fused, qp.get_default_qconfig_mapping("fbgemm"), calibration[0], backend="fbgemm")
    for batch in calibration:
        observed(*batch)
    report = qp.compare(model, qp.convert_fx(observed, backend="fbgemm"), (x,))
    rows = {layer.name: layer for layer in report.layers}
    assert rows["fc1"].float_type == "Linear+ReLU"
    assert rows["fc1"].sqnr_db > 30


def test_a_loaded_model_pairs_its_convs_with_the_float_value_after_the_folded_affine(affine_net, exported,
                                                                                      tmp_path):
    # the fold record was not saved: after qp.load the conv was paired with the float conv's own
    # output again (a Conv2d row far below the 30+ dB it reads before saving)
    model, _, x = affine_net
    path = qp.save(exported, tmp_path / "model.safetensors")
    before, after = qp.compare(model, exported, (x,)), qp.compare(model, qp.load(path), (x,))
    rows = [(layer.name, layer.float_type, layer.sqnr_db) for layer in after.layers]
    assert rows == [(layer.name, layer.float_type, layer.sqnr_db) for layer in before.layers]
    assert rows[0][:2] == ("conv", "Conv2d+affine") and rows[0][2] > 30


class ReluThenBn(nn.Module):
    """conv -> relu -> BatchNorm (lowered on its own, under a new name), conv -> bn + residual."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b1(torch.relu(self.c1(x)))
        return self.fc((self.b2(self.c2(y)) + y).mean((2, 3)))


def test_a_loaded_model_compares_like_the_model_that_was_saved(quantized, tmp_path, recwarn):
    # before: the loaded model had no prepare state naming its backend, so the float model was not
    # fused like it and every fused conv was skipped as unpairable (ResNet-18: 3 rows instead of 42);
    # its graph had no module stacks, so b1 (run by the int8 `batchnorm2d`) read "not found (fused?)"
    torch.manual_seed(0)
    small = ReluThenBn().eval()
    for bn in (small.b1, small.b2):
        bn.running_var.data.uniform_(0.5, 2.0)
        bn.running_mean.data.uniform_(-1.0, 1.0)
    calibration = [(torch.randn(2, 3, 8, 8),) for _ in range(2)]
    cases = [(quantized[0], quantized[1], quantized[2]),
             (small, qp.quantize(small, calibration[0], calibration, backend="fbgemm", progress=False),
              torch.randn(2, 3, 8, 8))]
    for index, (model, qmodel, x) in enumerate(cases):
        path = qp.save(qmodel, tmp_path / f"model{index}.safetensors")
        before, after = qp.compare(model, qmodel, (x,)), qp.compare(model, qp.load(path), (x,))
        assert after.to_dict() == before.to_dict()
        assert str(after) == str(before)
        assert before.layers and not before.skipped
    assert after.float_only_kinds == {"b1": "fused into batchnorm2d"}


class DropoutResidual(nn.Module):
    """Dropout and Identity (nothing in eval mode), a GELU module, and a ReLU after a residual add
    (fused with it into the int8 add_relu)."""

    def __init__(self) -> None:
        super().__init__()
        self.drop, self.ident = nn.Dropout(0.1), nn.Identity()
        self.fc1, self.gelu, self.fc2, self.act = nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), nn.ReLU()
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.fc2(self.gelu(self.fc1(self.ident(self.drop(x))))) + x))


@pytest.mark.parametrize("capture", ["symbolic", "export"])
def test_the_summary_says_what_each_float_module_without_a_counterpart_became(capture):
    # before: "4 float module(s) absent from the quantized model (fused?)", for a Dropout and an
    # Identity that do nothing at inference, a GELU that export runs as a function and one real fusion
    torch.manual_seed(0)
    model, x = DropoutResidual().eval(), torch.randn(16, 8)
    qmodel = qp.quantize(model, (x,), [(x,)], backend="fbgemm", capture=capture, progress=False)
    report = qp.compare(model, qmodel, (x,))
    gelu = {"gelu": "run as a function"} if capture == "export" else {}  # symbolic keeps the module
    assert report.float_only_kinds == {"drop": "no-op at inference", "ident": "no-op at inference", **gelu,
                                       "act": "fused into add_relu"}
    assert report.float_only == list(report.float_only_kinds)
    summary = " ".join(str(report).split())
    assert (f"{len(report.float_only)} float module(s) without a counterpart in the quantized model: no-op at "
            "inference: drop, ident; " + ("run as a function: gelu; " if gelu else "") + "fused into add_relu: act"
            ) in summary
    assert "fused?" not in summary

"""``qplug show-backend``: both pattern formats, kernels, fusions, qconfigs; unknown names."""

from __future__ import annotations

import operator

from cli_testkit import assert_one_line_error, invoke, run
from torch import nn

import qplug_core as qp
from qplug_core.cli.show_backend import _simple_text


def _row(document: dict, pattern: str) -> dict:
    return next(row for row in document["pattern_configs"] if row["pattern"] == pattern)


def test_reference_json_has_both_formats_fusions_and_qconfigs():
    result = invoke("show-backend", "reference", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["backend"]["name"] == "reference" and doc["backend"]["status"] == "ok"
    assert doc["backend"]["plugins"][0]["dist"] == "qplug-core"
    cbr = _row(doc, "ReLU <- BatchNorm2d <- Conv2d")
    assert cbr["simple"] == "(Conv2d, BatchNorm2d, ReLU)"
    assert cbr["fuser_method"].endswith("fuse_conv_bn_relu") and cbr["fused_module"] == "ConvBnReLU2d"
    assert cbr["observation_type"] == "OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT"
    assert cbr["dtype_configs"][0]["weight_dtype"] == "torch.qint8"
    assert all(row["kernel"] is None for row in doc["pattern_configs"])  # reference: no kernels
    static = doc["default_qconfigs"]["static"]
    assert static["available"] and static["global"].startswith("activation Histogram quint8")
    assert "LayerNorm" in static["kept_float"]
    assert doc["default_qconfigs"]["dynamic"]["global"] == "float (not quantized)"


def test_fbgemm_lists_its_kernels(plugin_autoload):
    doc = invoke("show-backend", "fbgemm", "--json").json()
    assert _row(doc, "Linear")["kernel"] == "quantized::linear"
    assert doc["backend"]["engine"] == "fbgemm" and doc["backend"]["n_kernels"] > 50


def test_a_branch_pattern_has_no_simple_form():
    assert _simple_text((nn.ReLU, (operator.add, qp.MatchAllNode, nn.Conv2d))) is None
    assert _simple_text((nn.ReLU, nn.Conv2d)) == "(Conv2d, ReLU)"


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("│")]


def _first_cells(text: str) -> list[str]:
    return [line.split("│")[1].strip() for line in _table_lines(text)]


def test_default_view_is_one_line_per_op_family_within_80_columns(plugin_autoload):
    result = invoke("show-backend", "fbgemm")
    assert result.exit_code == 0, result.stderr
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    families = [cell for cell in _first_cells(result.stdout.split("default qconfigs")[0]) if cell]
    assert len(families) == len(set(families)), "a family is listed twice"
    # Conv2d, F.conv2d, (Conv2d, BatchNorm2d, ReLU), ConvReLU2d, qat.ConvBn2d ... are one family
    assert "conv2d" in families and not {"Conv2d", "ConvReLU2d", "qat.ConvBn2d"} & set(families)
    doc = invoke("show-backend", "fbgemm", "--json").json()
    assert len(families) < len(doc["pattern_configs"]) / 2
    assert "conv2d" in result.stdout and "u8,s8,f32->u8" in result.stdout


def test_filters_and_the_full_table(plugin_autoload):
    conv = invoke("show-backend", "fbgemm", "--op", "Conv2d")
    assert conv.exit_code == 0, conv.stderr
    assert [c for c in _first_cells(conv.stdout.split("default qconfigs")[0]) if c] == ["conv2d"]
    full = invoke("show-backend", "reference", "--pattern", "BatchNorm2d", "--full", columns=200)
    assert full.exit_code == 0, full.stderr
    assert "fuse_conv_bn_relu" in full.stdout and "(Conv2d, BatchNorm2d, ReLU)" in full.stdout
    assert "Linear" not in full.stdout.split("default qconfigs")[0]
    every_conv = invoke("show-backend", "fbgemm", "--op", "conv")  # it suggested only 'conv3d'
    assert every_conv.exit_code == 0, every_conv.stderr
    assert {"conv1d", "conv2d", "conv3d", "convtranspose2d"} <= set(
        _first_cells(every_conv.stdout.split("default qconfigs")[0]))
    assert_one_line_error(invoke("show-backend", "reference", "--op", "cnov2d"), "no pattern family",
                          "did you mean")
    assert_one_line_error(invoke("show-backend", "reference", "--pattern", "Nope"),
                          "no pattern contains 'Nope'")


def test_unknown_backend_is_one_line_with_did_you_mean():
    assert_one_line_error(invoke("show-backend", "referense"), "no backend 'referense'",
                          "did you mean 'reference'?")


def test_unknown_backend_subprocess():
    assert_one_line_error(run("show-backend", "fbgem"), "did you mean 'fbgemm'?",
                          "qplug-fbgemm 0.1.0 provides 'fbgemm' but is not loaded")


def test_missing_name_is_a_usage_error():
    assert invoke("show-backend").exit_code == 2

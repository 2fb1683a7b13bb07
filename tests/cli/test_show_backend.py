"""``qplug show-backend``: both pattern formats, kernels, fusions, qconfigs; unknown names."""

from __future__ import annotations

import operator

from cli_testkit import assert_one_line_error, invoke, run
from torch import nn

import qplug_core as qp
from qplug_core.commands.show_backend import _simple_text


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
    assert static["available"] and static["global"].startswith("activation HistogramObserver quint8")
    assert "LayerNorm" in static["kept_float"]
    assert doc["default_qconfigs"]["dynamic"]["global"] == "float (not quantized)"


def test_fbgemm_lists_its_kernels(plugin_autoload):
    doc = invoke("show-backend", "fbgemm", "--json").json()
    assert _row(doc, "Linear")["kernel"] == "quantized::linear"
    assert doc["backend"]["engine"] == "fbgemm" and doc["backend"]["n_kernels"] > 50


def test_a_branch_pattern_has_no_simple_form():
    assert _simple_text((nn.ReLU, (operator.add, qp.MatchAllNode, nn.Conv2d))) is None
    assert _simple_text((nn.ReLU, nn.Conv2d)) == "(Conv2d, ReLU)"


def test_table_output():
    result = invoke("show-backend", "reference", columns=200)
    assert result.exit_code == 0
    assert "backend reference:" in result.stdout and "pattern configs" in result.stdout
    assert "default qconfigs" in result.stdout and "fuse_conv_bn_relu" in result.stdout


def test_unknown_backend_is_one_line_with_did_you_mean():
    assert_one_line_error(invoke("show-backend", "referense"), "no backend 'referense'",
                          "did you mean 'reference'?")


def test_unknown_backend_subprocess():
    assert_one_line_error(run("show-backend", "fbgem"), "did you mean 'fbgemm'?",
                          "qplug-fbgemm 0.1.0 provides 'fbgemm' but is not loaded")


def test_missing_name_is_a_usage_error():
    assert invoke("show-backend").exit_code == 2

"""``qplug demo``: the digits CNN trained, quantized and measured, float vs int8."""

from __future__ import annotations

import pytest
from cli_testkit import assert_one_line_error, invoke, run

from qplug_core.cli.demo import RANDOM_WEIGHT_SQNR_DB


def test_digits_on_fbgemm_json(plugin_autoload):
    result = invoke("demo", "--backend", "fbgemm", "--runs", "5", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["model"] == "digits" and doc["backend"] == "fbgemm"
    assert doc["accuracy"]["float"] > 0.95 and doc["accuracy"]["int8"] > 0.95
    assert doc["accuracy"]["test_images"] == 450
    report = doc["quantization"]
    assert len(report["fusions"]) == 3 and report["skipped"] == []
    assert {"quantized::conv2d", "quantized::add_relu", "quantized::linear"} <= set(report["kernels"].values())
    assert doc["latency"]["runs"] == 5 and doc["latency"]["speedup"] > 0
    assert doc["size"]["int8_bytes"] < doc["size"]["float_bytes"] / 3 and doc["size"]["method"]
    sqnr = doc["sqnr"]
    assert sqnr["output_db"] > 25 and len(sqnr["worst_layers"]) == 5
    worst = [float(layer["sqnr_db"]) for layer in sqnr["worst_layers"]]
    assert worst == sorted(worst)
    assert "using backend" not in result.stderr  # the backend was named


def test_default_backend_table_as_subprocess():
    result = run("demo", "--runs", "3")  # only the reference backend is loaded in tests
    assert result.exit_code == 0, result.stderr
    assert "qplug: using backend 'reference'" in result.stderr
    for text in ("top-1 accuracy", "median latency", "size", "worst 5 layers", "qplug quantization report"):
        assert text in result.stdout


def test_unknown_backend():
    assert_one_line_error(invoke("demo", "--backend", "qnnpak"), "did you mean 'qnnpack'?")


def test_unknown_model_is_a_usage_error():
    assert invoke("demo", "--model", "resnet19").exit_code == 2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["resnet18", "mobilenet_v2"])
def test_random_weight_models_report_output_sqnr(model, plugin_autoload):
    result = invoke("demo", "--model", model, "--backend", "fbgemm", "--runs", "3", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert "accuracy" not in doc and doc["sqnr"]["output_db"] > 10
    expected = RANDOM_WEIGHT_SQNR_DB[model]
    assert "random weights" in doc["note"] and f"expect about {expected} dB" in doc["note"]
    assert abs(doc["sqnr"]["output_db"] - expected) < 3, "the note's figure is out of date"

"""``qplug bench``: float vs int8 latency from one interleaved run."""

from __future__ import annotations

import json

from cli_testkit import SHAPE, assert_one_line_error, invoke, run


def test_factory_json(user_models):
    result = invoke("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "4",
                    "--backend", "reference", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["baseline"] == "float model" and doc["backend"] == "reference"
    latency = doc["latency"]
    assert latency["runs"] == 4 and latency["batch"] == 2 and latency["threads"] == 1
    assert 0 < latency["float"]["median_ms"] <= latency["float"]["p90_ms"]
    assert 0 < latency["int8"]["median_ms"] <= latency["int8"]["p90_ms"] and latency["speedup"] > 0
    assert "calibrating on random data" in result.stderr


def test_saved_model_against_its_reference_form(user_models, calibration_file, tmp_path,
                                                requires_save):
    out = tmp_path / "net.safetensors"
    assert invoke("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--out", str(out),
                  "--calibration", str(calibration_file), "--backend", "reference").exit_code == 0
    result = run("bench", str(out), "--example-shape", SHAPE, "--runs", "3", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["baseline"].startswith("reference form of the saved model")


def test_table_as_subprocess(user_models, tmp_path):
    result = run("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "3",
                 "--backend", "reference", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "speed-up:" in result.stdout and "median ms" in result.stdout


def test_bad_inputs(user_models):
    assert_one_line_error(invoke("bench", f"{user_models}:build", "--example-shape", "2,5",
                                 "--backend", "reference"), "cannot run on the example inputs")
    assert_one_line_error(invoke("bench", "nope_module_q:build", "--example-shape", SHAPE),
                          "cannot import 'nope_module_q'")
    assert invoke("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "1").exit_code == 2

"""``qplug bench``: float vs int8 latency from one interleaved run."""

from __future__ import annotations

import json

from cli_testkit import SHAPE, assert_one_line_error, invoke, run


def test_factory_json(user_models):
    result = invoke("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "4",
                    "--backend", "reference", "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["float_model"] == f"{user_models}:build" and doc["backend"] == "reference"
    latency = doc["latency"]
    assert latency["runs"] == 4 and latency["batch"] == 2 and latency["threads"] == 1
    for name in ("float", "int8"):
        timing = latency[name]
        assert 0 < timing["p10_ms"] <= timing["median_ms"] <= timing["p90_ms"]
        recomputed = (timing["p90_ms"] - timing["p10_ms"]) / timing["median_ms"]
        assert abs(timing["spread"] - recomputed) < 0.01  # the ms figures are rounded
    expected = latency["float"]["median_ms"] / latency["int8"]["median_ms"]
    assert abs(latency["speedup"] - expected) < 0.01 + 1e-3 * expected
    assert "calibrating on the example input" in result.stderr


def test_saved_model_quotes_no_speedup_without_its_float_model(user_models, calibration_file,
                                                                tmp_path):
    """A saved file holds no float original: timing it alone gives no ratio (a ratio against its
    simulated reference form would flatter int8); --float gives the real one."""
    out = tmp_path / "net.safetensors"
    assert invoke("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--out", str(out),
                  "--calibration", str(calibration_file), "--backend", "reference").exit_code == 0
    alone = run("bench", str(out), "--example-shape", SHAPE, "--runs", "3", cwd=tmp_path)
    assert alone.exit_code == 0, alone.stderr
    assert "speed-up of" not in alone.stdout and "pass --float MODULE:FACTORY" in alone.stdout
    assert "│ int8" in alone.stdout and "│ float" not in alone.stdout
    paired = run("bench", str(out), "--float", f"{user_models}:build", "--example-shape", SHAPE,
                 "--runs", "3", "--json", cwd=tmp_path)
    assert paired.exit_code == 0, paired.stderr
    doc = json.loads(paired.stdout)
    assert doc["float_model"] == f"{user_models}:build" and doc["latency"]["speedup"] > 0


def test_table_as_subprocess(user_models, tmp_path):
    result = run("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "3",
                 "--backend", "reference", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert "speed-up of int8 over float:" in result.stdout and "median ms" in result.stdout


def test_bad_inputs(user_models):
    assert_one_line_error(invoke("bench", f"{user_models}:build", "--example-shape", "2,5",
                                 "--backend", "reference"), "cannot run on the example inputs")
    assert_one_line_error(invoke("bench", f"{user_models}:build", "--example-shape", SHAPE,
                                 "--example-dtype", "int8"), "--example-dtype 'int8' is not one of", code=2)
    assert_one_line_error(invoke("bench", "nope_module_q:build", "--example-shape", SHAPE),
                          "cannot import 'nope_module_q'")
    assert invoke("bench", f"{user_models}:build", "--example-shape", SHAPE, "--runs", "1").exit_code == 2

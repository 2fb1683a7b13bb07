"""``qplug quantize`` and ``qplug report``: a user's factory in, a saved int8 model and its report
out; every bad input is one line on stderr and exit 1 (malformed options: exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_testkit import SHAPE, assert_one_line_error, invoke, run


def _quantize(models: str, factory: str, out: Path, *extra: str):
    return invoke("quantize", f"{models}:{factory}", "--example-shape", SHAPE, "--out", str(out),
                  "--backend", "reference", *extra)


# -- success (needs qp.save) -------------------------------------------------------------------------


def test_static_with_calibration_file_saves_and_reports(user_models, calibration_file, tmp_path):
    out = tmp_path / "net.safetensors"
    result = _quantize(user_models, "build", out, "--calibration", str(calibration_file), "--json")
    assert result.exit_code == 0, result.stderr
    doc = result.json()
    assert doc["out"] == str(out) and out.stat().st_size == doc["size_bytes"]
    assert doc["backend"] == "reference" and doc["mode"] == "static"
    assert [f["fused_type"] for f in doc["report"]["fusions"]] == ["ConvReLU2d"]
    assert "warning" not in result.stderr

    shown = invoke("report", str(out), "--json")
    assert shown.exit_code == 0, shown.stderr
    report = shown.json()
    assert report["backend"] == "reference" and report["size_bytes"] == out.stat().st_size
    assert report["saved_with"]["torch"] == torch.__version__ and "qplug-core" in report["saved_with"]
    assert report["report"]["quantized"] == doc["report"]["quantized"]
    text = invoke("report", str(out))
    assert text.exit_code == 0 and "qplug quantization report" in text.stdout


def test_a_bad_eval_file_is_refused_before_quantizing(user_models, calibration_file, tmp_path):
    """Held-out inputs may have other sizes than the example (sentences of other lengths), not
    another rank; that is said before minutes of quantizing, and nothing is written."""
    from safetensors.torch import save_file

    evaluation, out = tmp_path / "eval.safetensors", tmp_path / "net.safetensors"
    save_file({"batch0": torch.randn(4, 3, 8)}, str(evaluation))
    result = _quantize(user_models, "build", out, "--calibration", str(calibration_file), "--eval", str(evaluation))
    assert_one_line_error(result, "--eval tensor", "has shape (4, 3, 8)", "must have 4 dimensions")
    assert not out.exists()


def test_random_calibration_warns_loudly(user_models, tmp_path):
    result = _quantize(user_models, "build", tmp_path / "net.safetensors")
    assert result.exit_code == 0, result.stderr
    assert "qplug: warning: no --calibration file" in result.stderr
    assert "qplug quantization report" in result.stdout


def test_a_warning_of_qplugs_is_one_qplug_line_not_a_python_warning(user_models, tmp_path):
    """warn_user points at the caller's frame, which under the CLI is click's: the user read
    ``.../typer/main.py:1445: UserWarning: qplug: ...`` and the source line."""
    from safetensors.torch import save_file

    constant = tmp_path / "constant.safetensors"
    save_file({f"batch{i}": torch.ones(4, 3, 8, 8) for i in range(2)}, str(constant))
    result = _quantize(user_models, "build", tmp_path / "net.safetensors", "--calibration", str(constant))
    assert result.exit_code == 0, result.stderr
    assert "qplug: warning: calibration saw constant float inputs: input 0 (every value 1)" in result.stderr
    assert "UserWarning" not in result.stderr and "typer" not in result.stderr, result.stderr


@pytest.mark.slow  # two torch.exports (quantize, and the fused float model compared with)
def test_the_export_capture_warning_is_printed_once(user_models, tmp_path):
    """The comparison's own capture of the model printed it a second time."""
    result = _quantize(user_models, "size_branch", tmp_path / "net.safetensors")
    assert result.exit_code == 0, result.stderr
    assert result.stderr.count("does not trace symbolically") == 1, result.stderr


@pytest.mark.parametrize("mode,factory", [("dynamic", "build"), ("qat-convert", "qat")])
def test_dynamic_and_qat_convert(user_models, tmp_path, mode, factory):
    result = _quantize(user_models, factory, tmp_path / "net.safetensors", "--mode", mode, "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["mode"] == mode and "warning" not in result.stderr


def test_dynamic_layers_compare_against_the_fused_float_layers(user_models, calibration_file, tmp_path):
    """The dynamic flow fuses linear+relu: compared with the bare float linear, that layer read
    2.5 dB in the worst-layers table beside a 40 dB output."""
    out = tmp_path / "mlp.safetensors"
    result = _quantize(user_models, "mlp", out, "--mode", "dynamic", "--calibration", str(calibration_file), "--json")
    assert result.exit_code == 0, result.stderr
    accuracy = result.json()["accuracy"]
    assert accuracy["compared_against"] == "fused float model (qp.fuse_fx)"
    assert accuracy["output_sqnr_db"] > 30
    assert min(float(layer["sqnr_db"]) for layer in accuracy["worst_layers"]) > 30, accuracy["worst_layers"]


def test_npy_calibration_and_report_as_subprocess(user_models, tmp_path):
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((4, 3, 8, 8)))
    out = tmp_path / "net.safetensors"
    result = run("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--out", str(out),
                 "--calibration", "calib.npy", "--json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["out"] == str(out)
    shown = run("report", str(out), "--json")
    assert shown.exit_code == 0 and json.loads(shown.stdout)["backend"] == "reference"


# -- bad inputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,fragments", [
    ("no_such_module_xyz:build", ["cannot import 'no_such_module_xyz'"]),
    ("{m}:bulid", ["has no callable 'bulid'", "did you mean 'build'?"]),
    ("{m}:broken", ["{m}:broken() raised RuntimeError: weights.bin is missing"]),
    ("{m}:not_a_model", ["returned int, not a torch.nn.Module"]),
    ("{m}", ["is not MODULE:FACTORY"]),
    ("{m}:build_with_typo_and_no_match_at_all", ["has no callable"]),
])
def test_bad_model_spec(user_models, tmp_path, spec, fragments):
    spec = spec.format(m=user_models)
    result = invoke("quantize", spec, "--example-shape", SHAPE, "--out", str(tmp_path / "o.safetensors"))
    assert_one_line_error(result, *(f.format(m=user_models) for f in fragments))


def test_wrong_example_shape(user_models, tmp_path):
    result = invoke("quantize", f"{user_models}:build", "--example-shape", "2,3,9,9",
                    "--out", str(tmp_path / "o.safetensors"), "--backend", "reference")
    assert_one_line_error(result, "cannot run on the example inputs ((2, 3, 9, 9))")


def test_unknown_backend(user_models, tmp_path):
    result = invoke("quantize", f"{user_models}:build", "--example-shape", SHAPE,
                    "--out", str(tmp_path / "o.safetensors"), "--backend", "fbgem")
    assert_one_line_error(result, "no backend 'fbgem'", "did you mean 'fbgemm'?")


def _pickled_npy(path: Path) -> None:
    np.save(path, np.array([{"a": 1}], dtype=object), allow_pickle=True)


@pytest.mark.parametrize("name,write,fragment", [
    ("calib.npy", _pickled_npy, "pickles are refused"),
    ("calib.safetensors", lambda p: p.write_bytes(b"\x00" * 3), "cannot read calibration file"),
    ("calib.pt", lambda p: torch.save({"x": torch.zeros(1)}, p), "must end in .safetensors"),
    ("calib.npy", lambda p: np.save(p, np.zeros((4, 3, 5, 5), dtype=np.float32)),
     "has shape (4, 3, 5, 5) but --example-shape is 2,3,8,8"),
    ("calib.npy", lambda p: np.save(p, np.zeros((4, 3, 8, 8), dtype=np.int64)),
     "must be floating point"),
    ("missing.npy", None, "does not exist"),
])
def test_bad_calibration_file(user_models, tmp_path, name, write, fragment):
    path = tmp_path / name
    if write is not None:
        write(path)
    result = _quantize(user_models, "build", tmp_path / "o.safetensors", "--calibration", str(path))
    assert_one_line_error(result, fragment)


def test_qat_convert_of_a_plain_model(user_models, tmp_path):
    result = _quantize(user_models, "build", tmp_path / "o.safetensors", "--mode", "qat-convert")
    assert_one_line_error(result, "returned a plain Net, which was not prepared by qplug")


@pytest.mark.parametrize("args", [["--example-shape", "1,x,3"], ["--example-shape", "0,3"],
                                  ["--example-shape", SHAPE, "--mode", "int4"], ["--example-shape", SHAPE]])
def test_malformed_options_are_usage_errors(user_models, args):
    assert invoke("quantize", f"{user_models}:build", *args).exit_code == 2


def test_options_that_do_not_go_together_are_usage_errors(tmp_path):
    """Exit 2 as for a command line the parser rejects, checked before the file is read, in
    qplug's one-line form: a deployment script tells its own mistake (2) from a bad model (1)."""
    result = invoke("report", str(tmp_path / "missing.safetensors"), "--float", "m:f")
    assert_one_line_error(result, "--float and --eval go together", code=2)


def test_bad_input_as_subprocess(user_models, tmp_path):
    result = run("quantize", f"{user_models}:broken", "--example-shape", SHAPE,
                 "--out", str(tmp_path / "o.safetensors"), cwd=tmp_path)
    assert_one_line_error(result, "RuntimeError: weights.bin is missing")


@pytest.mark.parametrize("write,fragment", [
    (None, "no such file"),
    (lambda p: torch.save({"w": torch.zeros(2)}, p), "is a pickle file"),
    (lambda p: p.write_bytes(b"not a model"), "corrupt or not a safetensors file"),
])
def test_report_bad_files(tmp_path, write, fragment):
    path = tmp_path / "model.safetensors"
    if write is not None:
        write(path)
    assert_one_line_error(invoke("report", str(path)), fragment)
    if write is None:
        assert_one_line_error(run("report", str(path), "--json"), fragment)


def test_report_sensitivity_ranks_the_float_models_layers(user_models, calibration_file, tmp_path):
    out = tmp_path / "net.safetensors"
    assert _quantize(user_models, "build", out, "--calibration", str(calibration_file)).exit_code == 0
    args = ("report", str(out), "--sensitivity", f"{user_models}:build", "--example-shape", SHAPE,
            "--calibration", str(calibration_file))
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.stderr
    ranking = result.json()["sensitivity"]
    assert ranking["layers"] and all(set(row) >= {"name", "alone_int8", "alone_float"}
                                     for row in ranking["layers"])
    gains = [row["alone_float"]["sqnr_db"] for row in ranking["layers"]]
    assert gains == sorted(gains, reverse=True)  # what keeping a layer float buys, best first
    text = invoke(*args)
    assert text.exit_code == 0 and "per-layer sensitivity" in text.stdout
    missing = invoke("report", str(out), "--sensitivity", f"{user_models}:build")
    assert missing.exit_code == 2 and "--example-shape" in missing.stderr


def test_backend_auto_measures_what_is_installed(user_models, tmp_path):
    # only the core's reference backend is loaded here: auto says so and uses it
    out = tmp_path / "net.safetensors"
    result = invoke("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--out", str(out),
                    "--backend", "auto", "--json")
    assert result.exit_code == 0, result.stderr
    assert result.json()["backend"] == "reference"
    assert "backend='auto': no backend besides the reference form is available here" in result.stderr


def test_backend_auto_is_for_static_models_only(user_models, tmp_path):
    result = invoke("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--out",
                    str(tmp_path / "net.safetensors"), "--backend", "auto", "--mode", "dynamic")
    assert_one_line_error(result, "--backend auto measures static int8 models only, not --mode dynamic", code=2)


# -- files of models quantized by module swap (weight-only, W8A8) ------------------------------------


def _swapped_file(user_models: str, tmp_path: Path, kind: str) -> Path:
    import qplug_core as qp
    from qplug_core.cli._inputs import load_factory_model

    model = load_factory_model(f"{user_models}:mlp")
    batches = [torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    qmodel = (qp.quantize_weights(model, bits=4, group_size=64) if kind == "weight-only"
              else qp.quantize_w8a8(model, batches, quantize_head=True))
    return qp.save(qmodel, tmp_path / f"{kind}.safetensors")


@pytest.mark.parametrize("kind", ["weight-only", "W8A8"])
def test_report_bench_and_export_open_a_module_swap_file(user_models, calibration_file, tmp_path, kind):
    """qplug report / bench / export all said "pass the model to fill ... qp.load(path, model=...)",
    a Python-only way out, for every weight-only or W8A8 file qp.save wrote."""
    path = _swapped_file(user_models, tmp_path, kind)
    shown = invoke("report", str(path), "--json")
    assert shown.exit_code == 0, shown.stderr
    assert shown.json()["mode"] == kind and shown.json()["int8_layers"] == (
        {"linear": 2} if kind == "weight-only" else {"per_token_linear": 2})
    if kind == "weight-only":
        assert shown.json()["scheme"] == "int4 symmetric, groups of 64"

    measured = invoke("report", str(path), "--float", f"{user_models}:mlp", "--eval", str(calibration_file),
                      "--json")
    assert measured.exit_code == 0, measured.stderr
    accuracy = measured.json()["accuracy"]
    assert float(accuracy["output_sqnr_db"]) > (12 if kind == "weight-only" else 25)
    assert {layer["name"] for layer in accuracy["worst_layers"]} == {"1", "3"}  # the quantized ones only

    bare = invoke("bench", str(path), "--example-shape", SHAPE, "--runs", "3")
    assert_one_line_error(bare, f"holds a {kind} model (quantized by module swap)", "give --float MODULE:FACTORY")
    timed = invoke("bench", str(path), "--float", f"{user_models}:mlp", "--example-shape", SHAPE, "--runs", "3",
                   "--json")
    assert timed.exit_code == 0, timed.stderr
    assert timed.json()["latency"]["speedup"] > 0

    exported = invoke("export", str(path), str(tmp_path / "m.onnx"))
    assert_one_line_error(exported, f"holds a {kind} model", "qplug export writes converted graph models")
    assert not (tmp_path / "m.onnx").exists()


def test_quantize_keeps_the_model_with_w8a8_and_weight_only(user_models, calibration_file, tmp_path):
    """A language model's user had only graph modes in the CLI: the file had no generate(), and the
    warning's advice (qp.quantize_w8a8) had no CLI spelling."""
    out = tmp_path / "w8a8.safetensors"
    w8a8 = invoke("quantize", f"{user_models}:mlp", "--example-shape", SHAPE, "--out", str(out), "--mode", "w8a8",
                  "--calibration", str(calibration_file), "--json")
    assert w8a8.exit_code == 0, w8a8.stderr
    assert w8a8.json()["mode"] == "W8A8" and w8a8.json()["int8_layers"] == {"per_token_linear": 2}
    assert float(w8a8.json()["accuracy"]["output_sqnr_db"]) > 25
    assert "using backend" not in w8a8.stderr
    assert invoke("report", str(out), "--json").json()["mode"] == "W8A8"

    out = tmp_path / "int4.safetensors"
    int4 = invoke("quantize", f"{user_models}:mlp", "--example-shape", SHAPE, "--out", str(out),
                  "--mode", "weight-only", "--bits", "4", "--group-size", "64", "--json")
    assert int4.exit_code == 0, int4.stderr
    assert int4.json()["scheme"] == "int4 symmetric, groups of 64" and int4.json()["int8_layers"] == {"linear": 2}
    assert float(int4.json()["accuracy"]["output_sqnr_db"]) > 12

    chosen = invoke("quantize", f"{user_models}:mlp", "--example-shape", SHAPE, "--out", str(out),
                    "--mode", "weight-only", "--backend", "fbgemm")
    assert_one_line_error(chosen, "--mode weight-only picks the fastest kernels installed for each layer itself",
                          code=2)


def test_integer_example_dtype_without_calibration_blames_the_flag(user_models, tmp_path):
    """It said "the model has integer inputs" of a float CNN given --example-dtype int64 by mistake."""
    result = _quantize(user_models, "build", tmp_path / "net.safetensors", "--example-dtype", "int64")
    assert_one_line_error(result, "--example-dtype gives the model integer inputs (int64)",
                          "leave out --example-dtype for float inputs")


BAG_MODELS = """
import torch
from torch import nn


class SmallBag(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(100, 8, mode="sum")
        self.fc = nn.Linear(12, 4)

    def forward(self, dense, idx, off):
        return self.fc(torch.cat([dense, self.bag(idx, off)], 1))


def smallbag():
    torch.manual_seed(0)
    return SmallBag().eval()
"""
BAG_SHAPES = ("--example-shape", "8,4", "--example-shape", "24", "--example-shape", "8",
              "--example-dtype", "float32", "--example-dtype", "int64", "--example-dtype", "int64")


def test_a_bag_model_with_offsets_quantizes_from_its_calibration_file(tmp_path, monkeypatch):
    """The example inputs were ones for integer inputs even with --calibration: offsets [1, 1, ...]
    are invalid, and the error said "Pass example_inputs as a tuple", which no option does."""
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bagmodels.py").write_text(BAG_MODELS)
    gen = torch.Generator().manual_seed(0)
    save_file({key: value for b in range(3) for key, value in (
        (f"dense/{b}", torch.randn(8, 4, generator=gen)), (f"idx/{b}", torch.randint(0, 100, (24,), generator=gen)),
        (f"off/{b}", torch.arange(0, 24, 3)))}, str(tmp_path / "cal.safetensors"))
    try:
        done = invoke("quantize", "bagmodels:smallbag", *BAG_SHAPES, "--calibration", "cal.safetensors",
                      "--out", "bag.safetensors", "--backend", "reference", "--json")
        assert done.exit_code == 0, done.stderr
        assert "bag" in done.json()["report"]["quantized"]
        without = invoke("quantize", "bagmodels:smallbag", *BAG_SHAPES, "--mode", "dynamic",
                         "--out", "bag2.safetensors", "--backend", "reference")
        assert_one_line_error(without, "offsets[0] has to be 0", "--calibration FILE: its first batch is the example")
    finally:
        sys.modules.pop("bagmodels", None)


def test_report_of_a_graph_file_reads_its_header_and_loads_only_with_verify(user_models, tmp_path, monkeypatch):
    """Describing a saved static model loaded it (every tensor read, hashed and lowered: a
    BERT-base file took seconds and hundreds of MB) to print what its header records."""
    import os

    import qplug_core as qp
    from qplug_core.serialization import files

    path = tmp_path / "net.safetensors"
    assert _quantize(user_models, "build", path).exit_code == 0
    verified = invoke("report", str(path), "--verify", "--json")
    assert verified.exit_code == 0, verified.stderr
    loaded_report = verified.json()["report"]  # loaded: what the model itself reports
    with path.open("rb") as file:
        header = 8 + int.from_bytes(file.read(8), "little")
    read, pread = [], os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(len(got := pread(fd, n, offset))) or got)
    monkeypatch.setattr(os, "preadv", None)  # what reads tensors
    monkeypatch.setattr(files, "safe_open", None)  # nothing maps the file
    monkeypatch.setattr(qp, "load", None)  # nothing loads it
    shown = invoke("report", str(path), "--json")
    monkeypatch.undo()
    assert shown.exit_code == 0, shown.stderr
    described = shown.json()["report"]
    assert described.pop("notes")[-1].startswith("described from the file's header")
    assert described == {key: value for key, value in loaded_report.items() if key != "notes"}
    assert sum(read) <= 3 * header  # the header (its length, its checks, the document); no tensor

    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    assert invoke("report", str(path), "--json").exit_code == 0  # what the header says, unchecked
    assert_one_line_error(invoke("report", str(path), "--verify"), "contents changed after it was written")


def test_report_of_a_module_swap_file_reads_its_header_and_verifies_only_when_asked(user_models, tmp_path,
                                                                                  monkeypatch):
    """Describing a 1.45 GB weight-only file read, copied and hashed all of it (26 s, 3 GB) to print
    what its header says."""
    import os

    from qplug_core.serialization import files

    path = _swapped_file(user_models, tmp_path, "weight-only")
    with path.open("rb") as file:
        header = 8 + int.from_bytes(file.read(8), "little")
    read, mapped, pread, safe_open = [], [], os.pread, files.safe_open
    monkeypatch.setattr(os, "pread", lambda fd, n, offset: read.append(len(got := pread(fd, n, offset))) or got)
    monkeypatch.setattr(files, "safe_open", lambda *args, **kwargs: mapped.append(args) or safe_open(*args, **kwargs))
    shown = invoke("report", str(path), "--json")
    monkeypatch.undo()
    assert shown.exit_code == 0, shown.stderr
    assert shown.json()["int8_layers"] == {"linear": 2}
    # the header, read from the file; its tensors neither read nor mapped
    assert sum(read) < 3 * header < path.stat().st_size and not mapped

    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1  # a bit of the last tensor
    path.write_bytes(bytes(damaged))
    assert invoke("report", str(path), "--json").exit_code == 0  # what the header says, unchecked
    assert_one_line_error(invoke("report", str(path), "--verify"), "contents changed after it was written")

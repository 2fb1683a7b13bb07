"""What a newcomer reads: every command's output within 80 columns, and the quantize summary of a
transformer leading with its accuracy, compute ops by reason, shape plumbing in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_testkit import SHAPE, invoke, run

WIDTH = 80


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line.rstrip()) > WIDTH]


def _commands() -> list[tuple[str, ...]]:
    from qplug_core.cli.app import app

    listings = [("list-backends",), ("list-backends", "--no-load"), ("plugins",), ("doctor",),
                ("version",), ("--help",)]
    names = ["fbgemm", "onnxruntime", "qnnpack", "reference"]  # every backend this repo ships
    shown = [("show-backend", n) for n in names] + [("show-backend", n, "--full") for n in names]
    helps = [(command.name, "--help") for command in app.registered_commands if command.name]
    return listings + shown + helps


@pytest.mark.parametrize("args", _commands(), ids=" ".join)
def test_listings_and_help_fit_80_columns(plugin_autoload, args):
    result = invoke(*args, columns=WIDTH)
    assert result.exit_code == 0, result.stderr
    assert not _too_wide(result.stdout), "\n".join(_too_wide(result.stdout))


def test_model_commands_fit_80_columns(user_models, calibration_file, tmp_path, plugin_autoload):
    """quantize (plain and --verbose), report, bench, export and new-backend at 80 columns (paths
    relative to the current directory, as a user types them)."""
    out = "net.safetensors"
    quantize = ("quantize", f"{user_models}:build", "--example-shape", SHAPE, "--calibration",
                calibration_file.name, "--backend", "fbgemm", "--out", out)
    outputs = [invoke(*quantize), invoke(*quantize, "--verbose"), invoke("report", out),
               invoke("report", out, "--verbose"),
               invoke("bench", out, "--example-shape", SHAPE, "--runs", "3"),
               invoke("export", out, "net.onnx"), invoke("new-backend", "acme", "--dir", ".")]
    for result in outputs:
        assert result.exit_code == 0, result.stderr
        assert not _too_wide(result.stdout), "\n".join(_too_wide(result.stdout))


@pytest.mark.slow
def test_demo_fits_80_columns(plugin_autoload):
    result = invoke("demo", "--backend", "fbgemm", "--runs", "3", columns=WIDTH)
    assert result.exit_code == 0, result.stderr
    assert not _too_wide(result.stdout), "\n".join(_too_wide(result.stdout))


BERT_MODEL = '''
import torch
from torch import nn


class Bert(nn.Module):
    """A 2-layer BERT from its config (random weights), called with keyword inputs."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        self.bert = BertModel(BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=512,
                                         max_position_embeddings=64), add_pooling_layer=False)

    def forward(self, input_ids, attention_mask):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def build():
    return Bert().eval()
'''


@pytest.fixture
def bert_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import torch
    from safetensors.torch import save_file

    (tmp_path / "bertmodels.py").write_text(textwrap.dedent(BERT_MODEL))
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(3):
        tensors[f"input_ids/{i}"] = torch.randint(0, 1000, (2, 16), generator=gen)
        mask = torch.ones(2, 16, dtype=torch.int64)
        mask[1, 12:] = 0
        tensors[f"attention_mask/{i}"] = mask
    save_file(tensors, str(tmp_path / "calib.safetensors"))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("bertmodels", None)


BERT_ARGS = ("quantize", "bertmodels:build", "--example-shape", "2,16", "--example-shape", "2,16",
             "--example-dtype", "int64", "--calibration", "calib.safetensors", "--backend", "fbgemm")


@pytest.mark.slow
def test_bert_summary_leads_with_accuracy_and_folds_shape_ops(bert_project, plugin_autoload):
    text = run(*BERT_ARGS, "--out", "bert.safetensors", cwd=bert_project)
    assert text.exit_code == 0, text.stderr
    lines = text.stdout.splitlines()
    assert len(lines) <= 60 and not _too_wide(text.stdout), text.stdout
    assert any(line.startswith("accuracy vs float") for line in lines[:15]), text.stdout
    # every matmul of the encoder is int8; what is listed by reason are compute ops only
    assert "quantized::linear 12" in text.stdout
    plumbing = [line for line in lines if "shape and integer op(s)" in line]
    assert len(plumbing) == 1 and "--verbose" in text.stdout
    assert "sym_size" not in text.stdout.split(plumbing[0])[0]

    # the data stays complete: every float op is in report.skipped, marked with its kind (read from the
    # saved file: quantizing again for --json and --verbose cost two more BERT runs; quantize's own
    # --json and --verbose are tested on a small model above and in test_quantize_report.py)
    doc = json.loads(run("report", "bert.safetensors", "--json", cwd=bert_project).stdout)
    skipped = doc["report"]["skipped"]
    kinds = {entry["kind"] for entry in skipped}
    assert kinds <= {"compute", "shape", "integer"} and "compute" in kinds
    by_op = {entry["op"].split(".")[0]: entry["kind"] for entry in skipped}
    assert by_op["view"] == "shape" and by_op.get("gelu", "compute") == "compute"
    plumbing_count = sum(entry["kind"] != "compute" for entry in skipped)
    assert f"+ {plumbing_count} shape and integer op(s)" in " ".join(text.stdout.split())

    verbose = run("report", "bert.safetensors", "--verbose", cwd=bert_project)
    assert not _too_wide(verbose.stdout)
    listed = " ".join(verbose.stdout.split())
    assert all(f"{entry['node']} (" in listed for entry in skipped)

    # a saved exported model says how it was captured
    shown = run("report", "bert.safetensors", cwd=bert_project)
    assert "export capture" in shown.stdout.splitlines()[0], shown.stdout


def test_out_in_a_missing_folder_fails_before_the_model_is_built(user_models, tmp_path):
    sentinel = tmp_path / "factory-ran"
    (tmp_path / "slowmodel.py").write_text(textwrap.dedent(f'''
        from pathlib import Path
        from torch import nn

        def build():
            Path({str(sentinel)!r}).touch()
            return nn.Linear(4, 4)
        '''))
    result = invoke("quantize", "slowmodel:build", "--example-shape", "2,4",
                    "--out", str(tmp_path / "no_such_dir" / "x.safetensors"))
    sys.modules.pop("slowmodel", None)
    assert result.exit_code == 1 and "no_such_dir does not exist" in result.stderr
    assert not sentinel.exists()


def test_plugin_import_time_does_not_include_torch():
    """torch is imported before any plugin (built-ins too): a plugin's import time is its own."""
    script = textwrap.dedent('''
        import sys
        from qplug_core.registry import isolation as plugin_isolation
        from qplug_core.registry import plugins

        fence, seen = plugin_isolation.plugin_import, []

        def watched():
            seen.append("torch" in sys.modules)
            return fence()

        plugin_isolation.plugin_import = watched
        plugins.plugin_records()
        print(seen)
        ''')
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    seen = eval(done.stdout)  # a list of booleans printed by the script above
    assert seen and all(seen)


def test_slow_marker_is_registered_for_strict_markers(tmp_path):
    """A plugin's suite (the pattern suite marks cases slow) runs under --strict-markers."""
    (tmp_path / "test_marked.py").write_text(textwrap.dedent('''
        import pytest

        @pytest.mark.slow
        def test_long():
            pass
        '''))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "--strict-markers", str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    assert "1 passed" in done.stdout

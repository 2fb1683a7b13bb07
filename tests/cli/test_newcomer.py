"""What a newcomer runs after the demo, exactly as the docs show it: a token-input model quantized
from the shell, its accuracy, and tables that stay readable at 80 columns."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest
import torch
from cli_testkit import invoke, run

TOKEN_MODEL = '''
import torch
from torch import nn


class TinyEncoder(nn.Module):
    """Embedding + one transformer encoder layer + mean pooling over the mask."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.norm = nn.LayerNorm(32)
        self.ff1 = nn.Linear(32, 64)
        self.ff2 = nn.Linear(64, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, input_ids, attention_mask):
        h = self.norm(self.embed(input_ids))
        h = h + self.ff2(torch.relu(self.ff1(h)))
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((h * mask).sum(1) / mask.sum(1))


def build():
    torch.manual_seed(0)
    return TinyEncoder().eval()
'''


def _token_file(path: Path, batches: int, seed: int) -> Path:
    """A calibration file keyed NAME/INDEX, as docs/cli.md describes."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(batches):
        tensors[f"input_ids/{i}"] = torch.randint(0, 100, (4, 12), generator=gen)
        mask = torch.ones(4, 12, dtype=torch.int64)
        mask[:, 8 + i % 4:] = 0
        tensors[f"attention_mask/{i}"] = mask
    save_file(tensors, str(path))
    return path


@pytest.fixture
def token_project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A directory holding the model module and its calibration/evaluation files, made current."""
    (tmp_path / "tokmodels.py").write_text(textwrap.dedent(TOKEN_MODEL))
    _token_file(tmp_path / "calib.safetensors", 6, seed=1)
    _token_file(tmp_path / "eval.safetensors", 3, seed=2)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("tokmodels", None)


TOKEN_ARGS = ("--example-shape", "1,12", "--example-shape", "1,12", "--example-dtype", "int64")


def test_token_model_quantizes_from_the_shell_with_its_accuracy(token_project, plugin_autoload):
    out = token_project / "enc.qplug.safetensors"
    result = run("quantize", "tokmodels:build", *TOKEN_ARGS, "--calibration", "calib.safetensors",
                 "--eval", "eval.safetensors", "--backend", "fbgemm", "--out", str(out), "--json",
                 cwd=token_project)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    accuracy = doc["accuracy"]
    assert accuracy["evaluated_on"] == "--eval eval.safetensors" and accuracy["batches"] == 3
    assert accuracy["output_sqnr_db"] > 25 and accuracy["output_cosine"] > 0.99
    assert {layer["name"] for layer in accuracy["worst_layers"]} <= {"embed", "norm", "ff1", "ff2",
                                                                      "head"}
    assert set(doc["report"]["quantized"]) >= {"ff1", "ff2", "head"}
    # the saved model answers like the float one on the held-out inputs, from Python too
    from safetensors.torch import load_file

    import qplug_core as qp
    from qplug_core.cli._inputs import load_factory_model

    qmodel = qp.load(out)

    held_out = load_file(str(token_project / "eval.safetensors"))
    batch = (held_out["input_ids/0"], held_out["attention_mask/0"])
    assert qp.sqnr(load_factory_model("tokmodels:build")(*batch), qmodel(*batch)) > 25


def test_report_measures_accuracy_given_the_float_model(token_project):
    out = token_project / "enc.qplug.safetensors"
    assert run("quantize", "tokmodels:build", *TOKEN_ARGS, "--calibration", "calib.safetensors",
               "--backend", "reference", "--out", str(out), cwd=token_project).exit_code == 0
    text = run("report", str(out), "--float", "tokmodels:build", "--eval", "eval.safetensors",
               cwd=token_project)
    assert text.exit_code == 0, text.stderr
    assert re.search(r"accuracy vs float on --eval eval.safetensors \(3 batch\(es\)\): output "
                     r"SQNR [\d.]+ dB, cosine 0\.99\d+", " ".join(text.stdout.split()))
    assert "worst" in text.stdout and "layers by SQNR" in text.stdout


def test_token_inputs_need_real_calibration_and_matching_files(token_project):
    no_file = invoke("quantize", "tokmodels:build", *TOKEN_ARGS, "--out", "x.safetensors")
    assert no_file.exit_code == 1 and "pass --calibration FILE with real inputs" in no_file.stderr
    from safetensors.torch import save_file

    save_file({"input_ids/0": torch.zeros(4, 12, dtype=torch.int64),
               "atention_mask/0": torch.ones(4, 12, dtype=torch.int64)},
              str(token_project / "typo.safetensors"))
    typo = invoke("quantize", "tokmodels:build", *TOKEN_ARGS, "--calibration", "typo.safetensors",
                  "--out", "x.safetensors")
    assert typo.exit_code == 1 and "did you mean 'attention_mask'" in typo.stderr
    floats = invoke("quantize", "tokmodels:build", "--example-shape", "1,12", "--example-shape",
                    "1,12", "--calibration", "calib.safetensors", "--out", "x.safetensors")
    assert floats.exit_code == 1 and "must be floating point" in floats.stderr
    counts = invoke("quantize", "tokmodels:build", *TOKEN_ARGS, "--example-dtype", "int64",
                    "--example-dtype", "int64", "--out", "x.safetensors")
    assert counts.exit_code == 2 and "give one --example-dtype per input" in counts.stderr


_FRAME = re.compile(r"[\s│┃┏┓┗┛━─┡┩╇┳┻╋┼┴┬└┘┌┐├┤╭╮╰╯]+")
_NUMBER = re.compile(r"^[-+]?[\d.,]+(%|x|ms)?$")


def _words(text: str) -> Counter:
    """Every word of a rendering, numbers (timings) left out."""
    return Counter(w for w in _FRAME.split(text) if w and not _NUMBER.match(w))


@pytest.mark.parametrize("args", [
    ("list-backends",), ("plugins",), ("show-backend", "fbgemm"), ("show-backend", "qnnpack"),
    ("show-backend", "reference", "--full", "--op", "conv2d"),
])
def test_no_table_splits_a_word_at_80_columns(plugin_autoload, args):
    """Rendered at 80 columns, a table holds exactly the words it holds when nothing wraps."""
    narrow, wide = invoke(*args, columns=80), invoke(*args, columns=1000)
    assert narrow.exit_code == wide.exit_code == 0, narrow.stderr
    assert _words(narrow.stdout) == _words(wide.stdout)


def test_quantize_and_bench_tables_keep_words_whole(token_project):
    args = ("quantize", "tokmodels:build", *TOKEN_ARGS, "--calibration", "calib.safetensors",
            "--backend", "reference", "--out", "enc.safetensors")
    assert _words(invoke(*args, columns=80).stdout) == _words(invoke(*args, columns=1000).stdout)
    bench = ("bench", "tokmodels:build", *TOKEN_ARGS, "--backend", "reference", "--runs", "3")
    assert _words(invoke(*bench, columns=80).stdout) == _words(invoke(*bench, columns=1000).stdout)


@pytest.mark.parametrize("command", ["quantize", "bench", "report", "show-backend",
                                     "list-backends", "demo"])
def test_help_shows_flags_without_type_placeholders(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    assert "<bool>" not in result.stdout and "--json" in result.stdout


def test_messages_speak_the_language_of_their_reader(user_models, tmp_path):
    """The shell user is told about --backend and --calibration, the Python user about keywords."""
    shell = run("quantize", f"{user_models}:build", "--example-shape", "2,3,8,8", "--out",
                str(tmp_path / "m.safetensors"), cwd=tmp_path)
    assert shell.exit_code == 0, shell.stderr
    assert "choose one with --backend NAME" in shell.stderr and "backend=" not in shell.stderr

    import qplug_core as qp
    from qplug_core.cli._inputs import load_factory_model
    from qplug_core.errors import cli_audience

    observed = qp.prepare_fx(load_factory_model(f"{user_models}:build"), None,
                             (torch.randn(2, 3, 8, 8),), backend="reference")
    with pytest.raises(qp.errors.UncalibratedObserverError, match="allow_uncalibrated=True"):
        qp.convert_fx(observed)
    with cli_audience(), pytest.raises(qp.errors.UncalibratedObserverError) as raised:
        qp.convert_fx(observed)
    assert "--calibration batches" in str(raised.value) and "=True" not in str(raised.value)

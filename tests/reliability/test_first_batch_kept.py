"""What the final check keeps of the first calibration batch (flows/first_batch.py): nothing after
convert (an LM head's observed model held 500 MiB of logits after qp.convert_fx), no output above
the keep limit, and no "float output" from a graph a recipe changed before prepare (ResNet-18 under
recipe="dfq" was scored 35.3 dB against its bias-corrected graph, 39.0 dB against the user's model)."""

from __future__ import annotations

import pytest
import torch

import qplug_core as qp
from qplug_core import zoo
from qplug_core.flows import first_batch
from qplug_core.flows.final_check import score
from qplug_core.flows.tags import FIRST_BATCH

pytestmark = pytest.mark.usefixtures("installed_backends")


class Counted(torch.nn.Module):
    """A small MLP counting its calls with real tensors (tracing calls it with proxies)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.calls = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                    torch.nn.Linear(32, 64)), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            self.calls += 1
        return self.body(x)


def batches(n: int = 3) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 16, generator=gen),) for _ in range(n)]


def calibrated() -> torch.fx.GraphModule:
    observed = qp.prepare_fx(Counted().eval(), None, batches()[0], backend="fbgemm")
    with torch.no_grad():
        for x in batches():
            observed(*x)
    return observed


def test_convert_fx_leaves_no_kept_batch_on_the_observed_or_the_converted_model():
    observed = calibrated()
    assert observed.meta[FIRST_BATCH].output is not None
    qmodel = qp.convert_fx(observed)
    assert FIRST_BATCH not in observed.meta and FIRST_BATCH not in qmodel.meta
    assert qp.quantization_report(qmodel).final_check["sqnr_db"] > 20


def test_an_output_over_the_keep_limit_is_not_kept(monkeypatch):
    """Inputs 256 bytes, output 1 KiB, the limit between: only the inputs are kept; convert_fx
    says it did not check, qp.quantize runs the float model again."""
    monkeypatch.setattr(first_batch, "KEEP_LIMIT", 512)
    observed = calibrated()
    kept = observed.meta[FIRST_BATCH]
    assert kept.output is None and "MiB" in kept.unkept and torch.equal(kept.inputs[0], batches()[0][0])
    report = qp.quantization_report(qp.convert_fx(observed))
    assert report.final_check == {} and any("was not kept" in note for note in report.notes)
    model = Counted().eval()
    qmodel = qp.quantize(model, batches()[0], batches(), backend="fbgemm", recipe="none")
    assert model.calls == 1 and qp.quantization_report(qmodel).final_check["sqnr_db"] > 20


def test_dfq_is_checked_against_the_users_float_model():
    """Bias correction before prepare changes the graph calibration runs: its output is not kept."""
    model = zoo.get_model("digits_cnn", seed=0).eval()
    data = [zoo.example_inputs("digits_cnn", batch=2, seed=s) for s in range(3)]
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", recipe="dfq")
    with torch.no_grad():
        direct = score(qmodel(*data[0]), model(*data[0]))
    check = qp.quantization_report(qmodel).final_check
    assert direct is not None and check["sqnr_db"] == pytest.approx(direct.sqnr_db, abs=1e-6)

"""QAT under DistributedDataParallel (2 gloo ranks x 4 steps) with qp.distributed.data_parallel.

* every case: both ranks end with the same fake-quant qparams, and ``convert`` on either rank
  saves the same int8 model, byte for byte;
* BatchNorm statistics frozen, observers synced every step: the result matches one process
  training on the global batches within the tolerance docs/guide/distributed.md documents
  (gradient averaging rounds differently from one big batch): fake-quant scales within 1e-5
  relative and zero points within 1, int8 weights within 1 LSB, float tensors within 1e-5
  relative, outputs within 1% of their range.
"""

from __future__ import annotations

from pathlib import Path

import launch
import pytest
import torch
from qat_worker import CASES
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
SYNCED = [case for case, (_, every) in CASES.items() if every]


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qat")
    launch.run_script(HERE / "qat_worker.py", str(out), world=2, with_single=True, timeout=240)
    return out


def load(out: Path, case: str, kind: str, who: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"{case}.{kind}.{who}.safetensors"))


@pytest.mark.parametrize("case", SYNCED)
def test_ranks_end_with_identical_fake_quant_qparams(out, case):
    rank0, rank1 = load(out, case, "fq", "0"), load(out, case, "fq", "1")
    assert rank0 and rank0.keys() == rank1.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key


@pytest.mark.parametrize("case", SYNCED)
def test_convert_on_any_rank_gives_the_same_int8_model(out, case):
    assert ((out / f"{case}.int8.0.safetensors").read_bytes()
            == (out / f"{case}.int8.1.safetensors").read_bytes())


def test_without_qplug_the_ranks_disagree(out):
    """The control: plain DDP (no buffer broadcast) leaves each rank with its own activation ranges."""
    rank0, rank1 = load(out, "unsynced", "fq", "0"), load(out, "unsynced", "fq", "1")
    assert any(not torch.equal(rank0[key], rank1[key]) for key in rank0)


def test_matches_one_process_on_the_global_batches_within_tolerance(out):
    fq, fq_single = load(out, "bn_frozen", "fq", "0"), load(out, "bn_frozen", "fq", "single")
    assert fq.keys() == fq_single.keys()
    for key, expected in fq_single.items():
        if key.endswith("zero_point"):
            assert (fq[key] - expected).abs().max() <= 1, key
        else:
            torch.testing.assert_close(fq[key], expected, rtol=1e-5, atol=0, msg=key)
    int8, int8_single = load(out, "bn_frozen", "int8", "0"), load(out, "bn_frozen", "int8", "single")
    assert int8.keys() == int8_single.keys()
    for key, expected in int8_single.items():
        if expected.is_floating_point():
            torch.testing.assert_close(int8[key], expected, rtol=1e-5, atol=1e-8, msg=key)
        else:
            assert (int8[key].long() - expected.long()).abs().max() <= 1, key
    output = load(out, "bn_frozen", "out", "0")["output"]
    expected = load(out, "bn_frozen", "out", "single")["output"]
    assert (output - expected).abs().max() <= 0.01 * expected.abs().max()


def test_data_parallel_refuses_what_would_break_agreement(out):
    broadcast, sync_bn = (out / "errors.0.txt").read_text().splitlines()
    assert broadcast.startswith("ConfigValidationError: broadcast_buffers=True would replace")
    assert sync_bn.startswith("ConfigValidationError: sync_batchnorm=True needs the model on a GPU")

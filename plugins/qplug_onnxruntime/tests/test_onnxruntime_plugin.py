"""The installed qplug-onnxruntime distribution: discovery, delegation report, sessions, save/load."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from ort_testkit import inputs, quantized_pair

AVX2 = "fpu sse2 avx avx2 fma"  # AMD Zen 3, Intel before Cascade Lake
VNNI = "avx2 avx512f avx512bw avx512_vnni"  # AMD Zen 4

import qplug_core as qp
from qplug_core.plugin_api import (
    PAIRS_EXACT,
    PAIRS_SATURATE,
    ConfigValidationError,
    cpu_int8,
    float_weight_copies,
    override_cpu_flags,
    probe_pair_sums,
)

from qplug_onnxruntime import SessionSettings, configure, settings
from qplug_onnxruntime.session import OrtPartition


@pytest.fixture(scope="module")
def digits():
    with torch.no_grad():
        return quantized_pair("digits_cnn")


def partitions(model) -> list[OrtPartition]:
    return [m for m in model.modules() if isinstance(m, OrtPartition)]


def _qplug(*args: str) -> subprocess.CompletedProcess:
    """The installed ``qplug`` command, as a user runs it."""
    return subprocess.run([str(Path(sys.executable).with_name("qplug")), *args],
                          capture_output=True, text=True, timeout=300)


def test_entry_point_is_loaded_and_listed(qplug_only):
    record = qplug_only().record("onnxruntime")
    assert (record.dist, record.status.value) == ("qplug-onnxruntime", "ok")
    assert record.module.startswith("qplug_onnxruntime.plugin")
    result = _qplug("list-backends", "--json")
    assert result.returncode == 0, result.stderr
    (row,) = [b for b in json.loads(result.stdout)["backends"] if b["name"] == "onnxruntime"]
    assert row["available"] and [p["dist"] for p in row["plugins"]] == ["qplug-onnxruntime"]


def test_disabled_plugin_is_not_listed(monkeypatch):
    monkeypatch.setenv("QPLUG_DISABLE_PLUGINS", "onnxruntime")
    result = _qplug("list-backends", "--json")
    assert "onnxruntime" not in [b["name"] for b in json.loads(result.stdout)["backends"]]


def test_report_lists_the_partition_and_what_stayed_outside(digits):
    _, ort_model, _ = digits
    report = qp.quantization_report(ort_model)
    assert [(p["name"], p["module"]) for p in report.partitions] == [("delegate_0", "OrtPartition")]
    assert report.partitions[0]["int8_regions"] == len(report.quantized)
    assert set(report.kernels.values()) == {"delegate:delegate_0"}
    assert not report.skipped


def test_sessions_use_the_configured_threads_and_default_to_torchs():
    assert settings().num_threads is None
    previous = configure(num_threads=2)
    try:
        _, ort_model, _ = quantized_pair("digits_cnn", batches=1)
    finally:
        configure(num_threads=previous.num_threads)
    (partition,) = partitions(ort_model)
    assert partition.session_settings.num_threads == 2
    assert partition.sessions[0].get_session_options().intra_op_num_threads == 2
    partition.rebuild(SessionSettings())  # None: torch's thread count (one_thread fixture)
    assert partition.sessions[0].get_session_options().intra_op_num_threads == torch.get_num_threads()


def test_bad_settings_are_refused():
    with pytest.raises(ConfigValidationError, match="num_threads must be a positive int"):
        configure(num_threads=0)
    with pytest.raises(ConfigValidationError, match="graph_optimization must be one of"):
        SessionSettings(graph_optimization="max")


def test_one_session_serves_every_batch_of_two_or_more(digits):
    """The example is batch 1, which torch.export specialises: the first batch >= 2 gets a session
    with a symbolic batch axis, and every later batch size runs in it."""
    _, ort_model, reference = digits
    (partition,) = partitions(ort_model)
    with torch.no_grad():
        for batch in (3, 5, 2):
            x = inputs("digits_cnn", seed=5, batch=batch)
            got, expected = ort_model(*x), reference(*x)
            assert got.shape == (batch, 10)
            # the last linear writes float (no int8 op reads it): two steps of its range / 255
            assert (got - expected).abs().max() <= 2 * float(expected.max() - expected.min()) / 255
    assert len(partition.sessions) == 2
    assert [i.shape[0] for i in partition.sessions[0].get_inputs()] == [1]
    assert isinstance(partition.sessions[1].get_inputs()[0].shape[0], str)  # symbolic


def test_the_session_answering_depends_on_the_shapes_not_the_call_order(digits, tmp_path):
    _, ort_model, _ = digits
    path = qp.save(ort_model, tmp_path / "digits.safetensors")
    batches = {b: inputs("digits_cnn", seed=20 + b, batch=b) for b in (1, 4, 6)}
    with torch.no_grad():
        expected = {b: ort_model(*x) for b, x in batches.items()}
        for order in ((4, 1, 6), (1, 6, 4)):
            loaded = qp.load(path)
            for b in order:
                assert torch.equal(loaded(*batches[b]), expected[b]), (order, b)
            assert len(partitions(loaded)[0].sessions) == 2  # batch 1, and every batch >= 2


def test_save_load_rebuilds_the_sessions_from_the_reference_form(digits, tmp_path):
    model, ort_model, reference = digits
    # the reference forms kept (snapshot, the partition's own, qp.compare's) hold int8 weights, read
    # back in float bit-exactly: float copies kept a 256 MiB MLP at 2.3x its float model's bytes
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() > 1}
    assert float_weight_copies(ort_model, shapes) == []
    with torch.no_grad():
        x = inputs("digits_cnn", seed=6)
        assert torch.equal(partitions(ort_model)[0].partition(*x), reference(*x))
    path = qp.save(ort_model, tmp_path / "digits.safetensors")
    loaded = qp.load(path)
    report = qp.quantization_report(loaded)
    assert report.backend == "onnxruntime" and report.kernels == qp.quantization_report(ort_model).kernels
    assert not partitions(loaded)  # nothing compiled at load: the first call compiles, on its inputs
    x = inputs("digits_cnn", seed=7)
    with torch.no_grad():
        assert torch.equal(loaded(*x), ort_model(*x))
    # built from the ONNX models the file stores, one per signature the saved model had compiled
    assert len(partitions(loaded)) == 1 and len(partitions(loaded)[0].sessions) == len(partitions(ort_model)[0].sessions)
    assert float_weight_copies(loaded, shapes) == []
    assert qp.save(loaded, tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_a_save_stores_the_kept_sources_without_exporting(digits, tmp_path, monkeypatch):
    """Each session's ONNX model is kept beside it: each ``qp.save`` exported every signature
    again (MobileNetV2: ~14 s CPU each), as a rebuild did."""
    _, ort_model, _ = digits
    (partition,) = partitions(ort_model)
    exports, export = [], partition._serialize
    monkeypatch.setattr(partition, "_serialize", lambda *args: exports.append(1) or export(*args))
    x = inputs("digits_cnn", seed=8)
    with torch.no_grad():
        path = qp.save(ort_model, tmp_path / "digits.safetensors")
        assert torch.equal(qp.load(path)(*x), ort_model(*x))
    assert exports == []


def test_a_large_source_is_kept_in_a_file_the_session_is_built_from(digits, tmp_path, monkeypatch):
    _, ort_model, _ = digits
    path = qp.save(ort_model, tmp_path / "digits.safetensors")
    monkeypatch.setattr("qplug_core.partition.compiled.SOURCE_BYTES_IN_MEMORY", 1024)  # the digits CNN's: ~40 KB
    x = inputs("digits_cnn", seed=9)
    with torch.no_grad():
        loaded = qp.load(path)
        assert torch.equal(loaded(*x), ort_model(*x))
    (partition,) = partitions(loaded)
    assert partition.from_stored and {type(source).__name__ for source in partition.sources} == {"SourceFile"}


def test_a_file_from_a_vnni_cpu_loaded_without_vnni_is_checked_on_real_sessions(tmp_path):
    """Converted with VNNI's qparams (8-bit weights), loaded where ORT's U8S8 kernels sum pairs
    in int16: the first call checks the real session against the reference form (and would
    compile it again with 7-bit weights where the host's kernels saturate)."""
    from qplug_onnxruntime.probe import matmul_integer

    with override_cpu_flags(VNNI):
        _, ort_model, reference = quantized_pair("digits_cnn")
    converted = qp.quantization_report(ort_model)
    if not converted.partitions:  # this host's kernels saturate: its convert caught the 8-bit partition
        assert probe_pair_sums(matmul_integer) == PAIRS_SATURATE
        assert converted.reference and all("broke the kernel contract" in why for why in converted.reference.values())
        return  # (a VNNI CPU's file cannot be made here; tests/reliability/test_emulated_cpu_without_vnni.py)
    path = qp.save(ort_model, tmp_path / "digits.safetensors")
    x = inputs("digits_cnn", seed=9)
    with override_cpu_flags(AVX2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = qp.load(path)
        with torch.no_grad():
            out, expected = loaded(*x), reference(*x)
    (record,) = qp.quantization_report(loaded).partitions  # compiled, not the reference form
    notes = [str(w.message) for w in caught if "partition" in str(w.message)]
    if probe_pair_sums(matmul_integer) == PAIRS_SATURATE:  # this host's ORT kernels: 7 bits, said so
        assert record["note"].startswith("compiled with 7-bit weights in ") and len(notes) == 1
    else:  # its ORT kernels accumulate in int32: the check keeps the session as it was
        assert record["note"] == "" and not notes
        with torch.no_grad():
            assert torch.equal(out, ort_model(*x))
    assert qp.sqnr(expected, out) > 30


def test_doctor_probes_orts_own_int8_product(qplug_only):
    """MatMulInteger (MLAS's U8S8 GEMM, as in compiled partitions) on the worst case for int16
    pair sums, for real on this host: exact with VNNI; the doctor finding says what it did."""
    from qplug_onnxruntime.probe import matmul_integer

    codes = torch.randint(0, 256, (3, 70), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    weights = torch.randint(-64, 65, (5, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(matmul_integer(codes, weights).long(), codes.long() @ weights.long().t())  # 7-bit: exact
    result = probe_pair_sums(matmul_integer)
    assert result in (PAIRS_EXACT, PAIRS_SATURATE)
    if cpu_int8().vnni or cpu_int8().amx:
        assert result == PAIRS_EXACT
    (result_finding,) = qplug_only().collect("qplug_check_environment", backend="onnxruntime",
                                             plugin="onnxruntime")
    said = "saturated int16 pair sums" if result == PAIRS_SATURATE else "was exact"
    assert f"a worst-case probe on its kernels {said}" in result_finding.value[-1].message


def test_deepcopy_shares_the_sessions_without_exporting_and_rebuilds_its_own(digits, monkeypatch):
    _, ort_model, _ = digits
    (partition,) = partitions(ort_model)
    exports, export = [], partition._serialize
    monkeypatch.setattr(partition, "_serialize", lambda *args: exports.append(1) or export(*args))
    clone = copy.deepcopy(ort_model)
    (copied,) = partitions(clone)
    assert exports == [] and copied.sessions[0] is partition.sessions[0]  # ORT's run is thread-safe
    x = inputs("digits_cnn", seed=8)
    with torch.no_grad():
        assert torch.equal(clone(*x), ort_model(*x))
        session = partition.sessions[0]
        copied.rebuild(SessionSettings(num_threads=1))  # the copy's sessions only, from the sources kept
        assert exports == [] and copied.sessions[0] is not session and partition.sessions[0] is session
        assert torch.equal(clone(*x), ort_model(*x))


class _TwoInTwoOut(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x, y):
        h = self.a(x) + y
        return h, self.b(torch.relu(h))


def test_a_two_input_two_output_partition_answers_as_its_reference_form():
    torch.manual_seed(1)
    calibration = [(torch.randn(2, 8), torch.randn(2, 8)) for _ in range(4)]
    model = qp.quantize(_TwoInTwoOut(), calibration[0], calibration, backend="onnxruntime")
    (partition,) = partitions(model)
    x = (torch.randn(2, 8), torch.randn(2, 8))
    with torch.no_grad():
        got, expected = model(*x), partition.partition(*x)
    assert isinstance(got, tuple) and len(got) == 2
    for out, ref in zip(got, expected):
        assert out.shape == ref.shape and (out - ref).abs().max() <= 2 * float(ref.abs().max()) / 127


def test_hooks_on_the_only_partition_run_when_the_model_calls_it_directly(digits):
    _, ort_model, _ = digits
    (partition,) = partitions(ort_model)
    x = inputs("digits_cnn", seed=9)
    seen = []
    handle = partition.register_forward_hook(lambda module, args, out: seen.append(out.clone()) or out * 2)
    try:
        with torch.no_grad():
            doubled = ort_model(*x)
    finally:
        handle.remove()
    with torch.no_grad():
        plain = ort_model(*x)
    assert len(seen) == 1 and torch.equal(seen[0], plain) and torch.equal(doubled, plain * 2)

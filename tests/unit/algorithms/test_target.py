"""qp.sensitivity ranks the layer that hurts; qp.Target takes out the fewest layers to meet it."""

from __future__ import annotations

import pytest
import torch
from rich.console import Console
from torch import nn

import qplug_core as qp
from qplug_core.errors import ConfigValidationError
from qplug_core.flows.tags import TARGET

pytestmark = pytest.mark.usefixtures("one_thread")


class _OutlierInput(nn.Module):
    """Input channel 0 is 1000x the others (fc1's weight column compensates): per-tensor int8
    of fc1's input keeps only that channel, fc2 and fc3 see ordinary values."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.fc1.weight[:, 0] *= 1e-3

    def forward(self, x):
        x = x * torch.cat([torch.full((1,), 1000.0), torch.ones(15)])
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _OutlierChannel(nn.Module):
    """fc2's output channel 0 is 1000x the rest and stays so: with a per-tensor output grid
    channels 1-7 round to zero while every row's cosine stays ~1.0 (channel 0 dominates it)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)
        with torch.no_grad():
            self.fc2.weight[0] *= 1000.0
            self.fc2.bias[0] *= 1000.0

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _OutlierOutput(_OutlierChannel):
    """fc2's output channel 0 is 1000x the rest and leaves the model scaled back: a calibrated
    per-tensor output scale crushes the other channels; a float output does not."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("back", torch.cat([torch.full((1,), 1e-3), torch.ones(7)]))

    def forward(self, x):
        return super().forward(x) * self.back


def _data(n: int = 4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g),) for _ in range(n)]


def test_sensitivity_names_the_layer_that_hurts():
    data = _data()
    report = qp.sensitivity(_OutlierInput().eval(), data[0], data, backend="reference")
    assert report.layers[0].name == "fc1"
    worst_alone_int8 = min(report.layers, key=lambda s: s.alone_int8.sqnr_db)
    assert worst_alone_int8.name == "fc1"
    assert report.layers[0].alone_float.sqnr_db > report.all_int8.sqnr_db + 10
    assert report.to_dict()["layers"][0]["name"] == "fc1"
    text = str(report)  # print(report) shows the table, not the dataclass fields
    assert text.startswith("per-layer sensitivity (all int8: SQNR") and "LayerSensitivity(" not in text
    assert any(line.strip(" │|").startswith("fc1") for line in text.splitlines())


def test_sensitivity_prints_the_users_metric_beside_ours():
    """A user who ranks by their own score reads it in the table, each layer's alone int8 and float."""
    data = _data()

    def largest_error(expected, got):
        return float((torch.cat(expected) - torch.cat(got)).abs().max())

    report = qp.sensitivity(_OutlierInput().eval(), data[0], data, backend="reference", metric=largest_error)
    console = Console(width=200, record=True)
    report.print(console)
    text = console.export_text()
    assert f"metric {report.all_int8.metric:.4g}" in text
    fc1 = next(line for line in text.splitlines() if line.strip(" │|").startswith("fc1"))
    layer = report.layers[0]
    assert f"{layer.alone_int8.metric:.4g}" in fc1 and f"{layer.alone_float.metric:.4g}" in fc1, fc1
    assert layer.alone_float.metric < report.all_int8.metric  # fc1 float is what the metric wants too


def test_target_keeps_exactly_the_sensitive_layer_float():
    data = _data()
    model = _OutlierInput().eval()
    qmodel = qp.quantize(model, data[0], data, backend="reference",
                         target=qp.Target(sqnr=25, fallback="float", group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.float_layers == ["fc1"]
    assert result.all_int8.sqnr_db < 25 <= result.final.sqnr_db
    assert "local static int8 error" in result.decisions[0].reason
    assert result.quantizations == 2  # all int8, then fc1 out: one calibration for both
    assert set(qp.quantization_report(qmodel).quantized) == {"fc2", "fc3"}
    with torch.no_grad():  # the figure holds on data the search did not see
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        assert qp.sqnr(want, torch.cat([qmodel(*b) for b in held])) > 25


def test_dynamic_fallback_keeps_int8_weights_with_a_float_output():
    data = _data()
    qmodel = qp.quantize(_OutlierOutput().eval(), data[0], data, backend="reference",
                         target=qp.Target(cosine=0.999, group="layer", fallback="dynamic"))
    result = qmodel.meta[TARGET]
    assert result.met and result.float_layers == ["fc2"] and result.decisions[0].fallback == "dynamic"
    assert result.all_int8.cosine_mean < 0.999 <= result.final.cosine_mean
    assert "fc2" in qp.quantization_report(qmodel).quantized  # still int8 weights, run dynamically


def test_a_dynamic_fallback_behind_a_static_layer_runs_its_dynamic_kernel(plugin_autoload):
    """fc2 reads static fc1's int8 output: its dynamic kernel lowers (it used to fail to and
    quietly go float)."""
    from qplug_core.kernels import torch_int8 as K

    data = _data()
    model = _OutlierOutput().eval()
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm",
                         target=qp.Target(cosine=0.999, group="layer", fallback="dynamic"))
    result = qmodel.meta[TARGET]
    assert result.met and [(d.layers, d.fallback) for d in result.decisions] == [(("fc2",), "dynamic")]
    assert type(qmodel.fc2) is K.DynamicLinear
    report = qp.quantization_report(qmodel)
    assert "fc2" in report.kernels and "fc2" not in {s.node for s in report.skipped}
    with torch.no_grad():
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        got = torch.cat([qmodel(*b) for b in held])
    assert torch.nn.functional.cosine_similarity(want, got, dim=1).mean() > 0.999


def test_user_metric_and_an_unreachable_target_warns():
    data = _data()

    def max_error(reference, quantized):
        return -max(float((r - q).abs().max()) for r, q in zip(reference, quantized))

    with pytest.warns(UserWarning, match="accuracy target not met"):
        qmodel = qp.quantize(_OutlierInput().eval(), data[0], data, backend="reference",
                             target=qp.Target(metric=max_error, minimum=0.0, group="layer"))
    result = qmodel.meta[TARGET]
    assert not result.met and result.final.metric < 0


@pytest.mark.parametrize("kwargs,message", [
    ({}, "needs cosine="), ({"cosine": 2.0}, r"in \[-1, 1\]"),
    ({"metric": len}, "go together"), ({"sqnr": 20, "fallback": "fp16"}, "fallback must be"),
    ({"sqnr": 20, "group": "block"}, "group must be"),
    ({"cosine": 0.99, "neighbours": 92}, r"fraction of samples, in \[0, 1\]")])
def test_bad_targets_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigValidationError, match=message):
        qp.Target(**kwargs)


class _SharedInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.query, self.key = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.query(x)) - torch.relu(self.key(x))


def test_a_dynamic_linear_beside_a_static_one_on_the_same_input_lowers(plugin_autoload):
    data = _data()
    model = _SharedInput().eval()
    # fbgemm's own dynamic qconfig: safe on every CPU (7-bit weights where pairs sum in int16)
    dynamic = qp.get_default_qconfig_mapping("fbgemm", mode="dynamic").qconfig_for_module("", nn.Linear)
    mapping = qp.get_default_qconfig_mapping("fbgemm").set_module_name("key", dynamic)
    qmodel = qp.quantize(model, data[0], data, backend="fbgemm", qconfig_mapping=mapping,
                         recipe="none")
    report = qp.quantization_report(qmodel)
    assert {"query", "key"} <= set(report.kernels)
    with torch.no_grad():
        assert qp.sqnr(model(*data[0]), qmodel(*data[0])) > 25


def test_strict_with_a_target_that_keeps_a_layer_float_raises():
    data = _data()
    with pytest.raises(ConfigValidationError, match="strict=True but"):
        qp.quantize(_OutlierInput().eval(), data[0], data, backend="reference", strict=True,
                    target=qp.Target(sqnr=25, fallback="float", group="layer"))


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)

    def forward(self, input_ids, attention_mask):
        return self.embedding(input_ids) * attention_mask.unsqueeze(-1)


def test_scores_leave_out_the_tokens_the_attention_mask_marks_as_padding():
    from qplug_core.algorithms.sensitivity import float_outputs, padding_masks, score

    gm = torch.fx.symbolic_trace(_Tokens().eval())
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    batches = [(torch.randint(1, 10, (2, 5), generator=torch.Generator().manual_seed(0)), mask)]
    reference = float_outputs(gm, batches)
    padding_garbage = torch.zeros(2, 5, 4)
    padding_garbage[0, 3:] = 100.0

    def quantized(ids, attention_mask):
        return gm(ids, attention_mask) + padding_garbage

    masked = score(quantized, batches, reference, masks=padding_masks(gm, batches))
    assert masked.cosine_min == pytest.approx(1.0) and masked.sqnr_db == float("inf")
    unmasked = score(quantized, batches, reference)
    assert unmasked.cosine_min < 0.5
    assert padding_masks(torch.fx.symbolic_trace(nn.Linear(4, 4)), batches) == [None]


class _WithSideOutput(_OutlierInput):
    """A second output the score never reads (as a pooler beside last_hidden_state)."""

    def __init__(self) -> None:
        super().__init__()
        self.side = nn.Linear(16, 4)

    def forward(self, x):
        return super().forward(x), self.side(x)


def test_an_unreachable_target_never_takes_out_a_layer_that_buys_nothing():
    data = _data()
    with pytest.warns(UserWarning, match="not met even with 2 of 3 layer.*every layer float"):
        qmodel = qp.quantize(_WithSideOutput().eval(), data[0], data, backend="reference",
                             target=qp.Target(sqnr=200, fallback="float", group="layer"))
    result = qmodel.meta[TARGET]
    assert not result.met and "fc1" in result.float_layers
    assert "side" not in result.float_layers


@pytest.mark.parametrize("flags,expected", [("avx2 avx512f avx512bw avx512_vnni", "per_token"),
                                            ("fpu sse2 avx avx2 fma", "per_token"),
                                            ("fpu sse2 avx", "dynamic")])
def test_the_fallback_ladder_follows_the_cpu(tmp_path, flags, expected):
    """Where oneDNN's int8 GEMM runs (VNNI, or AVX2 with 7-bit weights) the layer goes per-token
    dynamic; where only ``torch._int_mm`` is left (25x fp32 without AVX2), per-tensor dynamic.
    Either way the target holds on held-out data."""
    from qplug_core.algorithms import fallbacks
    from qplug_core.kernels.per_token import PerTokenDynamicLinear
    from qplug_core.plugin_api import override_cpu_flags

    data = _data()
    model = _OutlierOutput().eval()
    with override_cpu_flags(flags):
        assert fallbacks.fallback_ladder()[0] == expected and fallbacks.fallback_ladder()[-1] == "float"
        qmodel = qp.quantize(model, data[0], data, backend="reference",
                             target=qp.Target(cosine=0.999, group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.float_layers == ["fc2"] and result.decisions[0].fallback == expected
    assert isinstance(qmodel.get_submodule("fc2"), PerTokenDynamicLinear) == (expected == "per_token")
    qp.save(qmodel, tmp_path / "model.qplug")  # the per-token layer comes back on load
    loaded = qp.load(tmp_path / "model.qplug")
    assert type(loaded.get_submodule("fc2")) is type(qmodel.get_submodule("fc2"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(*data[0]), qmodel(*data[0]), rtol=0, atol=0)
    with torch.no_grad():
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        got = torch.cat([qmodel(*b) for b in held])
    assert torch.nn.functional.cosine_similarity(want, got, dim=1).mean() > 0.999


@pytest.mark.parametrize("backend", ["fbgemm", "reference"])
def test_per_token_layers_without_vnni_are_chosen_and_built_with_the_gemms_7_bit_weights(backend,
                                                                                          plugin_autoload):
    """oneDNN sums u8 x s8 pairs in int16 without VNNI, so a per-token layer there holds weights
    in [-64, 64]: the search measures that layer's error with those weights (coarser than with
    VNNI's 8 bits), and the layer it builds holds them. The reference form simulates the full
    range on every CPU."""
    from qplug_core.kernels.per_token import PerTokenDynamicLinear
    from qplug_core.plugin_api import override_cpu_flags

    data = _data()
    found = {}
    for cpu, flags in (("vnni", "avx2 avx512f avx512bw avx512_vnni"), ("avx2", "fpu sse2 avx avx2 fma")):
        with override_cpu_flags(flags):
            qmodel = qp.quantize(_OutlierOutput().eval(), data[0], data, backend=backend,
                                 target=qp.Target(cosine=0.999, group="layer"))
        result = qmodel.meta[TARGET]
        layer = qmodel.get_submodule("fc2")
        assert result.met and result.decisions[0].fallback == "per_token"
        assert isinstance(layer, PerTokenDynamicLinear)
        errors = {e.name: e.errors for e in result.errors}
        found[cpu] = (errors["fc2"]["per_token"], int(layer.weight_int8_t.abs().max()))
    if backend == "reference":
        assert found["avx2"] == found["vnni"] and found["vnni"][1] == 127
    else:
        assert found["vnni"][1] == 127 and found["avx2"][1] == 64
        assert found["avx2"][0] > found["vnni"][0]


def test_a_rung_whose_local_error_stays_high_is_skipped_for_float(monkeypatch):
    """fc1's input outlier (1000x) crushes a per-batch dynamic grid as much as the static one:
    the ladder (dynamic, float) of a CPU without a fast per-token GEMM takes fc1 to float."""
    from qplug_core.algorithms import fallbacks

    monkeypatch.setattr(fallbacks, "per_token_is_fast", lambda: False)
    data = _data()
    qmodel = qp.quantize(_OutlierInput().eval(), data[0], data, backend="reference",
                         target=qp.Target(sqnr=25, group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.float_layers == ["fc1"] and result.decisions[0].fallback == "float"
    errors = {e.name: e.errors for e in result.errors}
    assert errors["fc1"]["dynamic"] > errors["fc2"]["static"]


def test_the_search_calibrates_once_and_reuses_the_observers(monkeypatch):
    from qplug_core.flows import steps as flows

    calls = []
    original = flows.calibrate
    monkeypatch.setattr(flows, "calibrate", lambda *a, **k: calls.append(1) or original(*a, **k))
    data = _data()
    qmodel = qp.quantize(_OutlierInput().eval(), data[0], data, backend="reference",
                         target=qp.Target(sqnr=25, fallback="float", group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.quantizations == 2 and len(calls) == 1
    # the reused observers are the calibrated ones: the same model as a fresh calibration gives
    mapping = qp.get_default_qconfig_mapping("reference").set_module_name("fc1", None)
    fresh = qp.quantize(_OutlierInput().eval(), data[0], data, backend="reference",
                        qconfig_mapping=mapping, recipe="none")
    with torch.no_grad():
        torch.testing.assert_close(qmodel(*data[0]), fresh(*data[0]), rtol=0, atol=0)


class _Encoder(nn.Module):
    """Token states [batch, tokens, hidden] beside an attention mask, as a sentence encoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.fc = nn.Embedding(20, 8), nn.Linear(8, 8)

    def forward(self, input_ids, attention_mask):
        return self.fc(self.embedding(input_ids)) * attention_mask.unsqueeze(-1)


def test_an_encoder_is_scored_by_its_pooled_embedding_and_neighbours():
    from qplug_core.algorithms.sensitivity import float_outputs, padding_masks, score

    gm = torch.fx.symbolic_trace(_Encoder().eval())
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    batches = [(torch.randint(0, 20, (4, 4), generator=g), mask)]
    reference = float_outputs(gm, batches)
    noise = torch.randn(4, 4, 8, generator=g) * 0.05

    def quantized(ids, attention_mask):
        return gm(ids, attention_mask) + noise

    got = score(quantized, batches, reference, masks=padding_masks(gm, batches), embedding=True)
    # the sentence-transformers embedding, computed here in float64 from its definition
    out = reference[0].double()
    weights = mask.unsqueeze(-1).double()

    def pooled(t):
        return torch.nn.functional.normalize((t * weights).sum(1) / weights.sum(1), dim=-1)

    cos = (pooled(out) * pooled(out + noise.double())).sum(-1)
    assert got.cosine_mean == pytest.approx(float(cos.mean()), abs=1e-6)
    assert got.cosine_min == pytest.approx(float(cos.min()), abs=1e-6)
    nearest = [(lambda s: s.fill_diagonal_(-2.0).argmax(1))(e @ e.T)
               for e in (pooled(out), pooled(out + noise.double()))]
    assert got.neighbours_kept == pytest.approx(float((nearest[0] == nearest[1]).double().mean()))


class _OutlierEncoder(nn.Module):
    """A sentence encoder whose embedding column 0 is 100x the others (fc1 compensates): static
    int8 of fc1's input keeps the cosines near 0.98 but moves most samples' nearest neighbour."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding, self.fc1, self.fc2 = nn.Embedding(20, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        with torch.no_grad():
            self.embedding.weight[:, 0] *= 100.0
            self.fc1.weight[:, 0] /= 100.0

    def forward(self, input_ids, attention_mask):
        hidden = self.fc2(torch.relu(self.fc1(self.embedding(input_ids))))
        return hidden * attention_mask.unsqueeze(-1)


def _sentences() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches of 16 token sequences, 2-6 real tokens each."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        lengths = torch.randint(2, 7, (16, 1), generator=g)
        batches.append((torch.randint(0, 20, (16, 6), generator=g), (torch.arange(6) < lengths).long()))
    return batches


def test_an_encoder_target_on_neighbours_takes_out_the_layer_that_moves_them():
    """The cosines alone are met with every layer int8 while most samples lose their nearest
    neighbour; asking for neighbours keeps the search going until they are kept."""
    data, model = _sentences(), _OutlierEncoder().eval()

    def search(**kwargs):
        target = qp.Target(cosine=0.9, group="layer", fallback="float", **kwargs)
        return qp.quantize(model, data[0], data, backend="reference", recipe="none",
                           target=target).meta[TARGET]

    cosines_only, with_neighbours = search(), search(neighbours=0.75)
    assert cosines_only.met and cosines_only.float_layers == []
    assert cosines_only.final.neighbours_kept < 0.75
    assert with_neighbours.met and with_neighbours.float_layers == ["fc1"]
    assert with_neighbours.final.neighbours_kept >= 0.75


def test_the_transformer_target_asks_the_embedding_to_keep_neighbours():
    """What recipe="auto" aims for: cosines that round to the promised ones are not enough when
    the pooled embeddings lose their nearest neighbours (a score without neighbours, not an
    embedding, is judged on its cosines)."""
    from dataclasses import replace

    from qplug_core.algorithms.sensitivity import OutputScore
    from qplug_core.algorithms.target import TRANSFORMER_TARGET

    close = OutputScore(sqnr_db=30.0, cosine_mean=0.9999, cosine_min=0.9999, neighbours_kept=1.0)
    assert TRANSFORMER_TARGET.misses(close) == []
    assert TRANSFORMER_TARGET.misses(replace(close, neighbours_kept=None)) == []
    missed = TRANSFORMER_TARGET.misses(replace(close, neighbours_kept=0.5))
    assert len(missed) == 1 and missed[0].startswith("neighbours 0.5 <")


def test_a_lost_output_channel_misses_the_target_that_row_cosines_would_meet():
    data = _data()
    model = _OutlierChannel().eval()
    qmodel = qp.quantize(model, data[0], data, backend="reference",
                         target=qp.Target(cosine=0.999, group="layer"))
    result = qmodel.meta[TARGET]
    # all int8: rows agree, channels 1-7 are gone
    assert result.all_int8.cosine_mean > 0.999 and result.all_int8.channel_cosine_min < 0.5
    assert result.met and "fc2" in result.float_layers and result.final.channel_cosine_min >= 0.5
    with torch.no_grad():  # every output channel holds on data the search did not see
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        got = torch.cat([qmodel(*b) for b in held])
    assert torch.nn.functional.cosine_similarity(want, got, dim=0).min() > 0.99
    # switched off, the row cosine alone is met by the all-int8 model
    plain = qp.quantize(model, data[0], data, backend="reference",
                        target=qp.Target(cosine=0.999, group="layer", channel_cosine=None))
    assert plain.meta[TARGET].met and plain.meta[TARGET].float_layers == []


class _ThreeLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def test_when_every_layer_out_still_misses_the_worst_fallbacks_go_float():
    """Without a fast per-token GEMM (x86 without AVX2) the ladder is (per-tensor dynamic, float).
    Here every layer out of static int8 on its first passing rung gives 40.7 dB (fc3 and fc1
    dynamic) for a 42 dB target: the dynamic layer that loses most then goes float too, short of
    the float model (it used to stop and warn at 40.7)."""
    from qplug_core.plugin_api import override_cpu_flags

    data = _data()
    model = _ThreeLinears().eval()
    with override_cpu_flags("fpu sse2 avx"):
        qmodel = qp.quantize(model, data[0], data, backend="reference", recipe="none",
                             target=qp.Target(sqnr=42, group="layer"))
    result = qmodel.meta[TARGET]
    assert result.met and result.final.sqnr_db >= 42 > result.all_int8.sqnr_db
    rungs = {name: d.fallback for d in result.decisions for name in d.layers}
    assert rungs == {"fc1": "dynamic", "fc2": "float", "fc3": "float"}
    (escalated,) = [d for d in result.decisions if d.layers == ("fc3",)]
    assert "float once every layer was out of static int8 and the target still missed (as dynamic" \
        in escalated.reason
    assert result.quantizations == 5  # all int8; 1, 2 and 3 layers out; then fc3 float too
    with torch.no_grad():
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        assert qp.sqnr(want, torch.cat([qmodel(*b) for b in held])) > 40


class _TokenStates(nn.Module):
    """A linear over token states beside an attention mask (an encoder's layer, alone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, hidden, attention_mask):
        return self.fc(hidden) * attention_mask.unsqueeze(-1)


def test_layer_errors_leave_out_padding_but_the_dynamic_grid_spans_it():
    """The local errors are those of the real tokens, whatever the padding holds; except the
    per-tensor dynamic rung's, whose kernel takes its grid from the whole batch at run time, so
    padding 1000x the real values crushes its real tokens too."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]])
    real = [torch.randn(2, 6, 8, generator=g) for _ in range(4)]
    errors = {}
    for padding in (0.0, 1000.0):
        batches = [(h.where(mask.unsqueeze(-1) != 0, torch.full_like(h, padding)), mask) for h in real]
        with pytest.warns(UserWarning, match="not met"):
            qmodel = qp.quantize(_TokenStates().eval(), batches[0], batches, backend="reference",
                                 recipe="none", target=qp.Target(sqnr=200, group="layer"))
        (found,) = qmodel.meta[TARGET].errors
        errors[padding] = found.errors
    quiet, loud = errors[0.0], errors[1000.0]
    assert set(quiet) >= {"static", "dynamic"}
    for kind in set(quiet) - {"dynamic"}:
        assert loud[kind] == pytest.approx(quiet[kind], rel=1e-4), kind
    assert loud["dynamic"] > 100 * quiet["dynamic"]


def test_a_missed_target_with_no_layer_the_search_can_rank_warns_and_returns_the_int8_model():
    """A ConvTranspose2d is quantized but not ranked (only Linear/Conv layers are): the search has
    nothing to take out, and says so (it raised UnboundLocalError)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(4, 4, 3), nn.ReLU()).eval()
    data = [(torch.randn(2, 4, 6, 6),) for _ in range(2)]
    with pytest.warns(UserWarning, match="accuracy target not met: the target search found no layer "
                                         r"it can take out of static int8 \(it ranks .*Linear and Conv1d/2d/3d"):
        qmodel = qp.quantize(model, data[0], data, backend="reference",
                             target=qp.Target(cosine=0.9999999))
    result = qmodel.meta[TARGET]
    assert not result.met and result.decisions == [] and result.quantizations == 1
    assert qp.quantization_report(qmodel).quantized  # the all-int8 model, not float


class _Kelvin(nn.Module):
    """A regressor whose outputs sit near a constant (a temperature in kelvin: ~300 +- 1): the
    output's per-tensor grid must hold 0, so its 256 levels span 0..301 and one step is ~1.2 K,
    about the outputs' whole spread, while being 0.4% of their size."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.head = nn.Linear(16, 32), nn.Linear(32, 1)
        with torch.no_grad():
            self.head.bias.fill_(300.0)

    def forward(self, x):
        return self.head(torch.relu(self.fc1(x)))


def test_a_regressor_near_a_constant_is_scored_on_its_spread_not_its_size():
    # field report s29 (FT-Transformer): cosine 0.9994 over one regression output a sample met
    # cosine=0.998 at 4e-3 of the outputs' variance; uncentred, this model's all-int8 form scored
    # ~0.99999 with an error about as large as the spread itself
    data = _data()
    model = _Kelvin().eval()
    qmodel = qp.quantize(model, data[0], data, backend="reference", target=qp.Target(cosine=0.998))
    result = qmodel.meta[TARGET]
    assert result.all_int8.cosine_mean < 0.9
    assert result.met and "head" in result.float_layers
    with torch.no_grad():
        held = _data(6)[4:]
        want = torch.cat([model(*b) for b in held])
        got = torch.cat([qmodel(*b) for b in held])
    assert float(((got - want) ** 2).mean() / want.var()) < 0.01

"""Issue 24: on x86 CPUs without VNNI, weight bits are chosen per layer from the layer's real
operands: 8 bits where no u8 x s8 int16 pair sum saturates, else 7-bit weights or 7-bit activations.

Decisions are tested under overridden CPU flags (``override_cpu_flags``); the emulation of
``vpmaddubsw`` they rest on is checked against a brute-force definition and against torch's own
convolution (the K order), and the chosen model runs on the host's real kernels.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
from torch import fx, nn

import qplug_core as qp
from qplug_core.flows import calibration_sample, steps, tags, weight_bits
from qplug_core.flows.snapshot import snapshot_of
from qplug_core.flows.tags import CALIBRATION_SAMPLE, TARGET, WEIGHT_BITS, WEIGHT_BITS_CHOICE
from qplug_core.kernels import pair_sums
from qplug_core.kernels.reference import Quantize, ReferenceWeighted
from qplug_core.plugin_api import override_cpu_flags
from tests.reliability.test_int16_pair_sums import AVX2, VNNI, vpmaddubsw_matmul


class TwoLayers(nn.Module):
    """``safe``: adjacent weights of opposite signs, so no pair of products can leave int16
    whatever the codes; ``hot``: positive weights on large positive inputs (``safe``'s bias
    keeps them in the top third of their grid), the worst case. ``hot``'s input also feeds the
    output (an add), so its grid is not ``hot``'s alone: the choice is ``hot``'s weight bits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.safe, self.hot = nn.Linear(32, 16), nn.Linear(16, 8)
        with torch.no_grad():
            self.safe.weight.uniform_(0.5, 1.0)
            self.safe.weight[:, 1::2] *= -1
            self.safe.bias.fill_(4.0)
            self.hot.weight.uniform_(0.5, 1.0)

    def forward(self, x):
        h = torch.relu(self.safe(x))
        return self.hot(h) + h[:, :8]


class OneConsumer(TwoLayers):
    """``hot`` is its input's only consumer: 7-bit activations are an option for it."""

    def forward(self, x):
        return self.hot(torch.relu(self.safe(x)))


def inputs(seed: int) -> tuple[torch.Tensor]:
    return (torch.rand(8, 32, generator=torch.Generator().manual_seed(seed)),)


def converted(backend: str, flags: str, mapping=None, model=TwoLayers, lowered: bool = False):
    with override_cpu_flags(flags):
        observed = qp.prepare_fx(model().eval(), mapping, inputs(0), backend=backend)
        qp.calibrate(observed, [inputs(s) for s in range(3)])
        return qp.convert_fx(observed) if lowered else qp.convert_to_reference_fx(observed)


def weight_ranges(reference) -> dict[str, tuple[int, int]]:
    return {name.split(".")[0]: (m.weight_qparams.quant_min, m.weight_qparams.quant_max)
            for name, m in reference.named_modules() if isinstance(m, ReferenceWeighted)}


def saturated(reference, held_out=None) -> dict[str, int]:
    """Saturated pair sums of each layer on held-out inputs, by the brute-force definition."""
    codes: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: codes.append(out))
             for m in reference.modules() if isinstance(m, Quantize)]
    with torch.no_grad():
        reference(*(inputs(5) if held_out is None else held_out))
    for hook in hooks:
        hook.remove()
    layers = {n.split(".")[0]: m for n, m in reference.named_modules() if isinstance(m, ReferenceWeighted)}
    weights = {n: torch.round(m.weight / m.weight_qparams.scale[:, None]).long() for n, m in layers.items()}
    return {name: vpmaddubsw_matmul(a, w)[1] for a, (name, w) in zip(codes, weights.items())}


EIGHT_BIT = {"fbgemm": (-128, 127), "onnxruntime": (-127, 127)}


@pytest.fixture(params=["fbgemm", "onnxruntime"])
def backend(request, qplug_only):
    qplug_only(f"qplug-{request.param}")
    return request.param


def test_per_layer_without_vnni(backend):
    reference = converted(backend, AVX2)
    assert weight_ranges(reference) == {"safe": EIGHT_BIT[backend], "hot": (-64, 64)}
    choices = reference.meta[WEIGHT_BITS_CHOICE]
    assert choices["safe"] == ("8-bit weights: no int16 pair sum saturates on the example inputs and 3 "
                               "calibration batch(es)")
    assert choices["hot"].startswith("7-bit weights: ") and "saturate with 8-bit weights" in choices["hot"]
    assert saturated(reference) == {"safe": 0, "hot": 0}


def test_seven_bit_activations_where_they_lose_less(backend):
    """``hot`` as its input's only consumer: 8-bit weights on a 7-bit grid for that input (pairs
    <= 2 x 127 x 128 fit int16) lose less than 7-bit weights on this data, so convert takes
    them; nothing saturates, and held-out outputs are closer to float than with 7-bit weights."""
    reference = converted(backend, AVX2, model=OneConsumer)
    assert weight_ranges(reference) == dict.fromkeys(("safe", "hot"), EIGHT_BIT[backend])
    grids = [(m.qparams.quant_min, m.qparams.quant_max) for m in reference.modules() if isinstance(m, Quantize)]
    assert grids[:2] == [(0, 255), (0, 127)]  # the model's input, hot's input
    assert reference.meta[WEIGHT_BITS_CHOICE]["hot"].startswith("8-bit weights on 7-bit activations: ")
    assert saturated(reference) == {"safe": 0, "hot": 0}
    with override_cpu_flags(AVX2):
        rule = qp.get_default_qconfig_mapping(backend)  # explicit: 7-bit weights, no choice
    by_rule = converted(backend, AVX2, rule, model=OneConsumer)
    with torch.no_grad():
        want = OneConsumer().eval()(*inputs(5))
        assert qp.sqnr(want, reference(*inputs(5))) > qp.sqnr(want, by_rule(*inputs(5)))


class ClampedConsumer(TwoLayers):
    """``OneConsumer`` with ReLU6 (folded into ``safe``'s output range) instead of ReLU."""

    def forward(self, x):
        return self.hot(torch.nn.functional.relu6(self.safe(x)))


def test_a_folded_clamp_keeps_its_8_bit_grid(backend):
    """A 7-bit grid cannot realise ReLU6 by saturation, so convert would have to keep the clamp
    (and ONNX Runtime would not fuse the conv with a Clip between): ``hot`` chooses weight bits
    instead, and the clamp is gone from the reference form."""
    reference = converted(backend, AVX2, model=ClampedConsumer)
    assert not reference.meta[WEIGHT_BITS_CHOICE]["hot"].startswith("8-bit weights on 7-bit activations")
    grids = [(m.qparams.quant_min, m.qparams.quant_max) for m in reference.modules() if isinstance(m, Quantize)]
    assert grids[:2] == [(0, 255), (0, 255)]
    assert not [n for n in reference.graph.nodes if n.target is torch.nn.functional.relu6]


def test_seven_bit_activations_run_on_the_hosts_kernels(backend):
    """The backend's kernels (or compiled partition) take the 7-bit input grid: none falls back
    to the reference form, and the outputs agree with it within a step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lowered = converted(backend, AVX2, model=OneConsumer, lowered=True)
    assert not qp.quantization_report(lowered).reference
    expected = snapshot_of(lowered).graph_module(*inputs(5))
    step = float(expected.max() - expected.min()) / 255
    assert float((lowered(*inputs(5)) - expected).abs().max()) <= 1.01 * step


def test_the_rule_removed_saturates(backend, monkeypatch):
    """8-bit weights everywhere (the per-layer rule removed): the hot layer's pair sums leave
    int16 on a CPU without VNNI (the emulation above), so the rule is what keeps it right."""
    monkeypatch.setattr(weight_bits._Losses, "of", lambda self, qparams, saturating, activations=None: (
        pair_sums.PairSums(0, torch.zeros(1)), 0.0))
    reference = converted(backend, AVX2)
    assert weight_ranges(reference)["hot"] == EIGHT_BIT[backend]
    assert saturated(reference)["hot"] > 0


def test_with_vnni_and_with_a_users_mapping_nothing_is_chosen(backend):
    reference = converted(backend, VNNI)
    assert weight_ranges(reference) == dict.fromkeys(("safe", "hot"), EIGHT_BIT[backend])
    assert WEIGHT_BITS_CHOICE not in reference.meta
    with override_cpu_flags(AVX2):
        mapping = qp.get_default_qconfig_mapping(backend)  # the user's now: kept as given
    reference = converted(backend, AVX2, mapping)
    assert weight_ranges(reference) == dict.fromkeys(("safe", "hot"), (-64, 64))


def test_the_choice_runs_on_the_host_kernels(backend):
    """Whatever this CPU is, its kernels compute what the reference form says."""
    with override_cpu_flags(AVX2):
        observed = qp.prepare_fx(TwoLayers().eval(), None, inputs(0), backend=backend)
        qp.calibrate(observed, [inputs(s) for s in range(3)])
        lowered = qp.convert_fx(observed)
    reference = qp.convert_to_reference_fx(observed)
    assert not qp.quantization_report(lowered).reference
    with torch.no_grad():
        expected, got = reference(*inputs(5)), lowered(*inputs(5))
    step = float(expected.max() - expected.min()) / 255
    assert float((got - expected).abs().max()) <= 1.01 * step


def test_a_calibration_batch_that_saturates_is_caught(backend, monkeypatch):
    """The example inputs (zeros: ``hot`` sees only ``safe``'s bias) saturate no pair sum, the
    calibration batches do: the batches kept from calibration make ``hot`` 7-bit. Without them
    (the sample removed) it would get 8-bit weights that saturate on held-out data like them."""
    example, batches = (torch.zeros(8, 32),), [(3 * inputs(s)[0],) for s in range(3)]
    held_out = (3 * inputs(5)[0],)

    def choose():
        with override_cpu_flags(AVX2):
            observed = qp.prepare_fx(TwoLayers().eval(), None, example, backend=backend)
            qp.calibrate(observed, batches)
            return qp.convert_to_reference_fx(observed)

    reference = choose()
    assert weight_ranges(reference)["hot"] == (-64, 64)
    assert "on the example inputs and 3 calibration batch(es)" in reference.meta[WEIGHT_BITS_CHOICE]["hot"]
    assert CALIBRATION_SAMPLE not in reference.meta  # the converted model holds no user data
    assert saturated(reference, held_out)["hot"] == 0
    monkeypatch.setattr(steps.calibration_sample, "start", lambda gm: None)
    example_only = choose()
    assert weight_ranges(example_only)["hot"] == EIGHT_BIT[backend]
    assert saturated(example_only, held_out)["hot"] > 0


def test_the_kept_batches_are_bounded_and_evenly_spread():
    gm = fx.symbolic_trace(nn.Linear(2, 2))
    gm.meta[WEIGHT_BITS] = (-128, 127)
    calibration_sample.keep(gm, [(i,) for i in range(100)])
    assert copy.deepcopy(gm).meta[CALIBRATION_SAMPLE] is gm.meta[CALIBRATION_SAMPLE]  # shared, not copied
    assert calibration_sample.take(gm) == [(i,) for i in range(0, 100, 16)]
    assert len(range(0, 100, 16)) <= calibration_sample.MAX_BATCHES and CALIBRATION_SAMPLE not in gm.meta
    calibration_sample.keep(gm, [(i,) for i in range(5)])
    assert calibration_sample.take(gm) == [(i,) for i in range(5)]


def quantized(backend: str, flags: str, **options):
    """``qp.quantize`` (a recipe or a target: the mapping is resolved before prepare) and the
    weight ranges of its reference form."""
    with override_cpu_flags(flags), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unmet target warns; these tests read its result
        qmodel = qp.quantize(TwoLayers().eval(), inputs(0), [inputs(s) for s in range(3)],
                             backend=backend, **options)
    return qmodel, weight_ranges(snapshot_of(qmodel).graph_module)


@pytest.mark.parametrize("options", [{"recipe": ["bias_correction"]}, {"target": qp.Target(sqnr=-100.0)}],
                         ids=["recipe", "target"])
def test_qp_quantize_defaults_get_the_choice(backend, options):
    """qp.quantize resolves the backend's defaults itself for a recipe or a target: they are
    still the defaults, so each layer gets its weight bits; a mapping the user passes is kept."""
    qmodel, ranges = quantized(backend, AVX2, **options)
    assert ranges == {"safe": EIGHT_BIT[backend], "hot": (-64, 64)}
    assert set(qmodel.meta[WEIGHT_BITS_CHOICE]) == {"safe", "hot"}


def test_bias_correction_is_for_the_weights_convert_gives(backend):
    """Bias correction runs before prepare, on the 7-bit default weights of a CPU without VNNI;
    convert then gives ``safe`` 8-bit weights. Each layer's bias is the float bias less the mean
    shift of the weights it really has, on the calibration data (not that of the 7-bit ones), on
    each channel whose shift stood out of its noise (the others keep the float bias)."""
    from qplug_core import qparams as Q

    qmodel, ranges = quantized(backend, AVX2, recipe=["bias_correction"])
    assert ranges == {"safe": EIGHT_BIT[backend], "hot": (-64, 64)}
    net = TwoLayers().eval()
    with torch.no_grad():
        layer_inputs = {"safe": [inputs(s)[0] for s in range(3)]}
        layer_inputs["hot"] = [torch.relu(net.safe(x)) for x in layer_inputs["safe"]]
    reference = snapshot_of(qmodel).graph_module
    for name, x in layer_inputs.items():
        converted_layer = reference.get_submodule(name)
        weight = getattr(net, name).weight.detach()

        linear = next(m for m in converted_layer.modules() if isinstance(m, nn.Linear))
        mask = getattr(linear, tags.BIAS_CORRECTION).mask
        assert float(mask.float().mean()) >= 0.75  # the guard leaves out only shifts within the noise

        def corrected(qparams, weight=weight, x=x, name=name, mask=mask):
            shift = torch.cat([nn.functional.linear(rows, Q.fake_quantize(weight, qparams) - weight)
                               for rows in x]).mean(0)
            return getattr(net, name).bias.detach() - shift * mask

        qparams = converted_layer.weight_qparams
        assert torch.allclose(linear.bias.detach(), corrected(qparams), rtol=1e-5, atol=1e-6), name
        if name == "safe":  # what the 7-bit grid needed is another bias
            seven = dataclasses.replace(qparams, quant_min=-64, quant_max=64,
                                        scale=qparams.scale * (qparams.quant_max / 64))
            assert not torch.allclose(linear.bias.detach(), corrected(seven), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("options", [{"recipe": ["bias_correction"]}, {"target": qp.Target(sqnr=-100.0)}],
                         ids=["recipe", "target"])
def test_qp_quantize_keeps_a_users_mapping(qplug_only, options):
    """The flow does not depend on the backend (fbgemm's: the faster one to convert)."""
    qplug_only("qplug-fbgemm")
    with override_cpu_flags(AVX2):
        mapping = qp.get_default_qconfig_mapping("fbgemm")
    qmodel, ranges = quantized("fbgemm", AVX2, qconfig_mapping=mapping, **options)
    assert ranges == dict.fromkeys(("safe", "hot"), (-64, 64)) and WEIGHT_BITS_CHOICE not in qmodel.meta


def test_a_target_ranks_layers_by_the_weights_they_get(qplug_only):
    """An unmet target takes layers out by their static int8 error: that error is the error of
    the weights convert gives the layer (8-bit ``safe`` as with VNNI, not 7-bit), and the models
    it tries with layers taken out get the choice too (the search is the same on every backend:
    fbgemm's, the faster one to convert)."""
    backend = "fbgemm"
    qplug_only("qplug-fbgemm")

    def static_errors(flags, **options):
        qmodel, ranges = quantized(backend, flags, target=qp.Target(sqnr=100.0), **options)
        result = qmodel.meta[TARGET]
        assert not result.met and result.float_layers
        kept = set(ranges) - set(result.float_layers)
        return {e.name: e.errors["static"] for e in result.errors}, ranges, kept

    avx2, ranges, kept = static_errors(AVX2)
    vnni, _, _ = static_errors(VNNI)
    assert avx2["safe"] == pytest.approx(vnni["safe"], rel=1e-6)
    assert all(ranges[name] == {"safe": EIGHT_BIT[backend], "hot": (-64, 64)}[name] for name in kept)
    with override_cpu_flags(AVX2):
        mapping = qp.get_default_qconfig_mapping(backend)
    users, _, _ = static_errors(AVX2, qconfig_mapping=mapping)  # 7-bit weights: a coarser grid
    assert users["safe"] > 1.5 * avx2["safe"]


@pytest.mark.parametrize(("model", "hot", "why", "hot_input_grid"), [
    (TwoLayers, (-64, 64), "7-bit weights: ", (0, 255)),
    (OneConsumer, EIGHT_BIT["fbgemm"], "8-bit weights on 7-bit activations: ", (0, 127))],
    ids=["7-bit weights", "7-bit activations"])
def test_a_targets_tries_take_the_first_converts_weight_bits(qplug_only, monkeypatch, model, hot, why,
                                                             hot_input_grid):
    """A target search converts the same calibrated layers once per try: each try takes the
    all-int8 convert's weight bits, input grids and reasons, instead of running the example and
    the kept calibration batches through the graph again (a third of each try's convert on
    all-int8 MiniLM with a CPU without VNNI's decisions)."""
    qplug_only("qplug-fbgemm")
    recorded = []
    run = weight_bits._Inputs.run
    monkeypatch.setattr(weight_bits._Inputs, "run", lambda self, *args: recorded.append(args) or run(self, *args))
    with override_cpu_flags(AVX2), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qp.quantize(model().eval(), inputs(0), [inputs(s) for s in range(3)], backend="fbgemm",
                             target=qp.Target(sqnr=52.0))
    result, reference = qmodel.meta[TARGET], snapshot_of(qmodel).graph_module
    assert result.met and result.quantizations == 2 and result.float_layers == ["safe"]
    assert len(recorded) == 4  # the example and 3 calibration batches, for the all-int8 convert only
    assert weight_ranges(reference) == {"hot": hot}
    grids = [(m.qparams.quant_min, m.qparams.quant_max) for m in reference.modules() if isinstance(m, Quantize)]
    assert grids[0] == hot_input_grid
    assert qmodel.meta[WEIGHT_BITS_CHOICE]["hot"].startswith(why)


@pytest.mark.parametrize("conv", [nn.Conv2d(6, 4, 3, padding=1, stride=2), nn.Conv2d(6, 6, 3, padding=1, groups=6),
                                  nn.Conv2d(6, 4, 1, groups=2), nn.Linear(9, 5)], ids=str)
def test_emulated_pair_sums_follow_the_kernels_k_order(conv):
    """The operands reproduce torch's integer convolution, and their pair sums the brute-force
    ``vpmaddubsw`` definition (count and what saturation takes from each output)."""
    gen = torch.Generator().manual_seed(0)
    zero_point = 3
    shape = (2, 6, 7, 7) if isinstance(conv, nn.Conv2d) else (4, 9)
    x = torch.randint(100, 256, shape, generator=gen).float()
    w = torch.randint(-20, 128, conv.weight.shape, generator=gen).float()  # mostly positive
    (a, high, low), wk = pair_sums.operands(conv, x, zero_point), pair_sums.weight_operands(conv, w)
    if isinstance(conv, nn.Conv2d):
        expected = nn.functional.conv2d(x - zero_point, w, None, conv.stride, conv.padding, groups=conv.groups)
        got = torch.einsum("gmk,gnk->gmn", a - zero_point, wk)
        groups, _, per_group = got.shape
        got = got.permute(1, 0, 2).reshape(2, -1, groups * per_group).permute(0, 2, 1).reshape(expected.shape)
        assert torch.equal(got, expected)
    assert (high >= a.amax(1)).all() and (low <= a.amin(1)).all()  # the ranges bound every column
    sums = pair_sums.pair_sums(a, wk, high, low)
    brute = [vpmaddubsw_matmul(a[g], wk[g]) for g in range(a.shape[0])]
    assert sums.saturated == sum(count for _, count in brute) > 0
    exact = torch.einsum("gmk,gnk->gmn", a.long(), wk.long())
    assert torch.equal(exact - torch.stack([out for out, _ in brute]), sums.shortfall)


def test_sampled_rows_keep_every_rows_column_ranges():
    conv = nn.Conv2d(4, 4, 3, padding=1)
    x = torch.randint(0, 256, (2, 4, 9, 9), generator=torch.Generator().manual_seed(1)).float()
    full, high, low = pair_sums.operands(conv, x, 7)
    sample, sampled_high, sampled_low = pair_sums.operands(conv, x, 7, max_rows=10)
    assert sample.shape[1] == 10 and torch.equal(sampled_high, high) and torch.equal(sampled_low, low)
    rows = torch.linspace(0, full.shape[1] - 1, 10).long()
    assert torch.equal(sample, full[:, rows])

"""The qplug_delegate hook: a third-party backend that compiles int8 partitions (an "NPU")."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import warnings

import pytest
import torch
from torch import nn

import qplug_core as qp
from qplug_core.registry.plugins import QplugPluginWarning

NPU = '''
import torch
from torch import nn
from qplug_core.plugin_api import (
    BackendSpec,
    CompiledPartition,
    Delegate,
    OperatorSupportBase,
    DTypeConfigSet,
    default_qconfig_mapping,
    hookimpl,
)

COMPILED = []


class Compiled(nn.Module):
    """Stands for an SDK's compiled subgraph: runs the partition and records its inputs."""

    def __init__(self, partition, example_inputs):
        super().__init__()
        self.partition = partition
        self.shapes = [tuple(x.shape) for x in example_inputs]
        outputs = partition(*example_inputs)
        if not all(isinstance(out, torch.Tensor) for out in (outputs if isinstance(outputs, tuple) else [outputs])):
            raise TypeError("the SDK's graph outputs are tensors")
        COMPILED.append(self)

    def forward(self, *args):
        if args[0].shape[0] == RAISES_AT_BATCH:
            raise RuntimeError(f"the NPU has no kernel for batch {RAISES_AT_BATCH}")
        out = self.partition(*args)
        if OUTPUT_SCALE != 1.0 and out.is_floating_point():
            out = out * OUTPUT_SCALE
        if OUTPUT_BITS < 8 and out.is_floating_point():
            step = float(out.max() - out.min()) / (2 ** OUTPUT_BITS - 1)
            out = torch.round(out / step) * step
        if TRIM:
            out = out[..., :-1]
        if OUTPUT_SHIFT:  # one step up on every output (the region check's tuple too)
            out = tuple(map(_shifted, out)) if isinstance(out, tuple) else _shifted(out)
        return out * -1.0 if WRONG else out


def _shifted(out):
    """``out`` OUTPUT_SHIFT steps up: integers, and floats in steps of their range / 255."""
    if out.is_floating_point():
        return out + OUTPUT_SHIFT * float(out.max() - out.min()) / 255
    return (out.to(torch.int16) + OUTPUT_SHIFT).clamp(0, 255).to(out.dtype)


def _wrong_on_1x1(partition):
    """An SDK mishandling 1x1 convolutions (their weights come out 1.5x): wrong in that layer only."""
    import copy

    partition = copy.deepcopy(partition)
    for module in partition.modules():
        if isinstance(module, nn.Conv2d) and module.kernel_size == (1, 1):
            with torch.no_grad():
                module.weight.mul_(1.5)
    return partition


class TakesAllButLinear(OperatorSupportBase):
    def is_node_supported(self, submodules, node):
        if SUPPORT_RAISES:
            raise RuntimeError("npu driver not loaded")
        module = submodules.get(node.target) if node.op == "call_module" else None
        return not isinstance(getattr(module, "module", module), nn.Linear)

    def unsupported_reason(self, submodules, node):
        if REASON_RAISES:
            raise RuntimeError("npu driver not loaded")
        return None


def _wrong_after_norm(partition):
    """An SDK quantizing LayerNorm's outputs on another grid: wrong in a region holding no int8 op."""
    import copy

    partition = copy.deepcopy(partition)
    for node in partition.graph.nodes:
        source = node.args[0] if node.op == "call_module" and node.args else None
        if "quantize" in node.name and "dequantize" not in node.name and getattr(source, "target", "") == "act":
            partition.get_submodule(node.target).scale *= 1.5
    return partition


class Session(CompiledPartition):
    """Stands for a runtime compiling one model per input signature, which fails (``AT_BATCH_1 =
    "fail"``) or computes the wrong numbers (``"wrong"``) at batch 1 only."""

    builds = 0

    def __init__(self, partition, example_inputs):
        super().__init__(partition, example_inputs, lambda _, inputs: bytes([inputs[0].shape[0]]))

    def build(self, source):
        Session.builds += 1
        if source == bytes([1]) and AT_BATCH_1 == "fail":
            raise RuntimeError("the SDK has no kernel for this op at batch 1")
        return source

    def run(self, compiled, inputs):
        if RUN_RAISES:
            raise RuntimeError("the NPU lost its device")
        out = self.partition(*inputs)
        return [out * -1.0 if compiled == bytes([1]) and AT_BATCH_1 == "wrong" else out]


def _compile(partition, example_inputs):
    if AT_BATCH_1:
        return Session(partition, example_inputs)
    if any(isinstance(m, nn.ReLU) for m in partition.modules()) and FAIL:
        raise RuntimeError("the SDK rejected the subgraph")
    if WRONG_AFTER_NORM:
        partition = _wrong_after_norm(partition)
    if ZERO_POINT_SHIFT:  # writes every int8 value one step up: a zero-point off by one
        import copy

        partition = copy.deepcopy(partition)
        for module in partition.modules():
            if type(module).__name__ == "Quantize":
                module.zero_point += ZERO_POINT_SHIFT
    if MUTATE:  # folds the biases into its own copy and zeroes them in the partition it was given,
        import copy  # and moves its weights off their int8 grid

        own = copy.deepcopy(partition)
        with torch.no_grad():
            for module in partition.modules():
                if isinstance(module, nn.Conv2d):
                    module.bias.zero_()
                    module.weight.add_(0.1)
        partition = own
    if SWAP_1X1:  # swaps its 1x1 convolutions for stand-ins of its own in the partition it was handed
        for module in partition.modules():
            if getattr(getattr(module, "module", None), "kernel_size", None) == (1, 1):
                module.module = nn.Identity()
    return Compiled(_wrong_on_1x1(partition) if WRONG_1X1 else partition, example_inputs)


FAIL = False
AT_BATCH_1 = ""  # "fail" or "wrong": compiled partitions are Sessions, refused at batch 1 only
WRONG = False  # an SDK whose compiled subgraph computes the wrong numbers
WRONG_1X1 = False  # an SDK wrong in its 1x1 convolutions only
WRONG_AFTER_NORM = False  # an SDK wrong in quantizing a float op's outputs
TRIM = False  # an SDK dropping the last column of its outputs
OUTPUT_SCALE = 1.0  # an SDK dequantizing its float outputs with the wrong scale
OUTPUT_BITS = 8  # an SDK rounding its float outputs on a coarser grid (over their range)
SUPPORT_RAISES = False  # an operator support probing a driver that is missing
REASON_RAISES = False  # an operator support probing that driver to explain a refusal
ZERO_POINT_SHIFT = 0  # an SDK whose quantize writes codes this many steps off
OUTPUT_SHIFT = 0  # a runtime whose outputs are this many steps up (a vendor's ~1-step bias)
MUTATE = False  # a graph-rewriting SDK that modifies the partition it is handed
SWAP_1X1 = False  # an SDK rewriting the modules of the partition it is handed
RAISES_AT_BATCH = 0  # an SDK whose compiled subgraph raises at one batch size
RUN_RAISES = False  # a runtime whose compiled models raise when they run (set by a test)
FLOAT_OUTPUTS = frozenset()  # the weighted ops whose output stays float where no int8 op reads it


@hookimpl
def qplug_register_backends():
    return [BackendSpec("npu", "a compiling backend", float_outputs=FLOAT_OUTPUTS)]


@hookimpl
def qplug_backend_pattern_configs(backend):
    return DTypeConfigSet.native().pattern_configs() if backend == "npu" else []


@hookimpl
def qplug_default_qconfig_mapping(backend, mode):
    return default_qconfig_mapping(mode) if backend == "npu" else None


@hookimpl
def qplug_delegate(backend):
    if backend != "npu":
        return None
    return Delegate(operator_support=TakesAllButLinear(), compile=_compile)
'''


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(4, 2)
        self.conv2 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = self.conv2(self.relu(self.conv(x)))
        return self.fc(y.mean((2, 3)))


def _quantize(backend):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 3, 6, 6, generator=g),) for _ in range(2)]
    observed = qp.prepare_fx(Net().eval(), None, data[0], backend=backend)
    qp.calibrate(observed, data)
    return observed, data


def test_partitions_are_compiled_and_the_rest_stays_in_pytorch(fake_dist):
    fake_dist("qplug-npu", NPU)
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert [p["module"] for p in report.partitions] == ["Compiled"]
    assert report.partitions[0]["int8_regions"] == 3  # conv-relu, conv2 and mean; fc is outside
    assert report.outside["fc"] == "backend 'npu' does not take Linear"
    assert report.kernels == dict.fromkeys(["conv", "conv2", "mean"], "delegate:delegate_0")
    assert report.reference == {"fc": "backend 'npu' does not take Linear"}
    assert [(s.node, s.reason) for s in report.skipped] == [("fc", report.reference["fc"])]
    assert lowered.delegate_0.shapes == [(2, 3, 6, 6)]
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))


def test_a_failing_compile_keeps_the_reference_form_with_a_warning(fake_dist):
    fake_dist("qplug-npu", NPU.replace("FAIL = False", "FAIL = True"))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match="compiling partition delegate_0 failed .*SDK rejected") as caught:
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert report.partitions == [] and "SDK rejected" in report.reference["conv"]
    # the summary counts the layers of the failed partition too (it said 1: fc alone)
    assert any(str(w.message).startswith("qplug: 3 int8 layer(s) run in PyTorch") and "'conv', 'conv2' (named above)"
               in str(w.message) for w in caught)
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))


def test_a_failing_compile_is_planned_without_its_regions_and_loads_as_saved(fake_dist, tmp_path):
    """The failed partition's int8 regions stay in reference form and the partitions are planned
    again without them, as qp.load plans them from the file: the file loads, and answers as saved."""
    observed, data = _deep(fake_dist, wrong=False, fail=True)
    with pytest.warns(UserWarning, match="SDK rejected"):
        lowered = qp.convert_fx(observed)
    loaded = qp.load(qp.save(lowered, tmp_path / "failed.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), lowered(*data[1]))
    assert qp.quantization_report(loaded).kernels == qp.quantization_report(lowered).kernels


def test_a_wrong_compiled_partition_breaks_the_kernel_contract_and_keeps_the_reference_form(fake_dist):
    fake_dist("qplug-npu", NPU.replace("WRONG = False", "WRONG = True"))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"qplug: backend 'npu': partition delegate_0 compiled by "
                                         r"plugin \S*npu\S* \(qplug-npu 0.1\) broke the kernel "
                                         r"contract on the example inputs \(its outputs point away "
                                         r"from the reference's \(cosine -1.00\)"):
        lowered = qp.convert_fx(observed)
    _assert_reference_kept(lowered, reference, data, ("conv", "conv2", "mean"), "broke the kernel contract")


@pytest.mark.parametrize("fault", ["WRONG", "TRIM"])
def test_a_loaded_partition_is_checked_at_its_first_call_on_every_cpu(fake_dist, tmp_path, fault):
    """The compile at the first call after qp.load is a new compile (another runtime version,
    another host): held to the contract on its first inputs even where convert's CPU and this one
    both have VNNI. A wrong one keeps the reference form, with a warning naming plugin and partition."""
    fake_dist("qplug-npu", NPU)
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    path = qp.save(qp.convert_fx(observed), tmp_path / "npu.safetensors")
    setattr(importlib.import_module("qplug_npu"), fault, True)  # the serving host's SDK is wrong
    loaded = qp.load(path)
    with pytest.warns(UserWarning, match=r"qplug: backend 'npu': partition delegate_0 compiled by plugin \S*npu\S* "
                                         r"\(qplug-npu 0.1\) broke the kernel contract on its first inputs after "
                                         r"qp.load .*reference form kept"), torch.no_grad():
        assert torch.equal(loaded(*data[1]), reference(*data[1]))
    report = qp.quantization_report(loaded)
    assert report.partitions == [] and "broke the kernel contract" in report.reference["conv"]


def test_a_compile_modifying_its_partition_leaves_the_saved_reference_form_right(fake_dist, tmp_path):
    """A compiler zeroing the biases of the partition it was handed (after copying it for itself)
    corrupted the reference form qp.save writes: the file was wrong everywhere, silently. Its
    weights, moved off their grid too, come back bit-exactly from the int8 values kept for them."""
    fake_dist("qplug-npu", NPU.replace("MUTATE = False", "MUTATE = True"))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"qplug: backend 'npu' \(plugin \S*npu\S* \(qplug-npu 0.1\)\)'s compile "
                                         r"modified the partition it was given \(.*weight.*bias.*\); qplug put its values back"):
        lowered = qp.convert_fx(observed)
    path = qp.save(lowered, tmp_path / "npu.safetensors")
    with torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))
        assert torch.equal(qp.load(path, backend="reference")(*data[1]), reference(*data[1]))


def _converted(fake_dist, npu: str, warning: str):
    """``Net`` converted by the NPU plugin ``npu`` with a warning matching ``warning``: the model,
    its reference form and the data."""
    fake_dist("qplug-npu", npu)
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=warning):
        lowered = qp.convert_fx(observed)
    return lowered, reference, data


def test_a_compile_changing_its_partition_s_modules_is_refused_and_they_are_put_back(fake_dist, tmp_path):
    """The partition's modules are the model's: refused, the compile still left the model's
    reference form with a stand-in where its 1x1 convolution was."""
    lowered, reference, data = _converted(
        fake_dist, NPU.replace("SWAP_1X1 = False", "SWAP_1X1 = True"),
        r"compiling partition delegate_0 failed \(PluginContractError: backend 'npu' \(plugin \S*npu\S* \(qplug-npu "
        r"0.1\)\)'s compile changed the graph or modules of the partition it was given \(qplug put them back\)")
    assert qp.quantization_report(lowered).partitions == []
    path = qp.save(lowered, tmp_path / "npu.safetensors")
    with torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))
        assert torch.equal(qp.load(path, backend="reference")(*data[1]), reference(*data[1]))


def test_an_operator_support_that_raises_is_named_as_the_plugin_s_error(fake_dist):
    """It was a PassError naming a core pass, as if qplug had failed."""
    from qplug_core.errors import PluginHookError

    fake_dist("qplug-npu", NPU.replace("SUPPORT_RAISES = False", "SUPPORT_RAISES = True"))
    observed, _ = _quantize("npu")
    with pytest.raises(PluginHookError, match=r"backend 'npu': the operator support of plugin \S*npu\S* "
                                              r"\(qplug-npu 0.1\) raised in is_node_supported on node '\w+' "
                                              r"\(RuntimeError: npu driver not loaded\)") as raised:
        qp.convert_fx(observed)
    assert raised.value.dist == "qplug-npu"


def test_an_unsupported_reason_that_raises_costs_the_explanation_only(fake_dist):
    """It failed the whole conversion: an explanation of a node is_node_supported already refused
    changes nothing that runs. The partition is compiled as before, the report and one warning say
    the explanation raised, and name the plugin."""
    lowered, reference, data = _converted(
        fake_dist, NPU.replace("REASON_RAISES = False", "REASON_RAISES = True"),
        r"qplug: backend 'npu': the operator support of plugin \S*npu\S* \(qplug-npu 0.1\) raised in "
        r"unsupported_reason on 1 node\(s\) \('fc'; first: RuntimeError: npu driver not loaded\)")
    report = qp.quantization_report(lowered)
    assert [p["module"] for p in report.partitions] == ["Compiled"]
    assert report.outside["fc"] == ("backend 'npu' does not take Linear: its unsupported_reason raised "
                                    "RuntimeError: npu driver not loaded")
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))


def _assert_reference_kept(lowered, reference, data, anchors, why):
    """No partition compiled, ``why`` reported for each int8 anchor, the reference form's numbers."""
    report = qp.quantization_report(lowered)
    assert report.partitions == []
    assert all(why in report.reference[n] for n in anchors)
    # G5: the fallback is reported, region by region (never the partition call as one op)
    listed = {s.node: s for s in report.skipped}
    assert "delegate_0" not in listed
    assert all(why in listed[n].reason and not listed[n].partition for n in anchors)
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))


class Deep(nn.Module):
    """Several int8 regions in one partition, the 1x1 convolution in the middle of them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.inner = nn.Conv2d(8, 8, 1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        y = self.conv3(torch.relu(self.inner(torch.relu(self.conv(x)))))
        return self.fc(y.mean((2, 3)))


def _deep(fake_dist, wrong: bool, fail: bool = False, model: nn.Module | None = None, npu: str = NPU):
    fake_dist("qplug-npu", npu.replace("WRONG_1X1 = False", f"WRONG_1X1 = {wrong}").replace(
        "FAIL = False", f"FAIL = {fail}"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 3, 8, 8, generator=g),) for _ in range(3)]
    observed = qp.calibrate(qp.prepare_fx((model or Deep()).eval(), None, data[0], backend="npu"), data)
    return observed, data


class DeepEnd(Deep):
    """Deep, its partition's output the float mean (no Linear after it)."""

    def forward(self, x):
        return self.conv3(torch.relu(self.inner(torch.relu(self.conv(x))))).mean((2, 3))


def _refused_whole(observed, data, match: str) -> None:
    """Converting ``observed`` warns ``match`` and keeps the reference form: no partition compiled."""
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=match):
        lowered = qp.convert_fx(observed)
    assert qp.quantization_report(lowered).partitions == []
    with torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))


def test_a_multi_region_partition_with_a_wrong_output_scale_keeps_the_reference_form(fake_dist):
    """Its regions' integer codes are right and its outputs point the right way: only the float
    value of its output is 1.5x too large, which neither the cosine nor the region check saw (the
    error is hundreds of times the reference form's own rounding noise)."""
    observed, data = _deep(fake_dist, wrong=False, model=DeepEnd(), npu=NPU.replace("OUTPUT_SCALE = 1.0",
                                                                                      "OUTPUT_SCALE = 1.5"))
    _refused_whole(observed, data, r"partition delegate_0 compiled by plugin \S*npu\S* .*broke the kernel contract "
                                   r"on the example inputs \(its outputs are off by \d+\.\dx the reference form's own "
                                   r"activation-rounding noise")


def test_a_multi_region_partition_far_less_accurate_than_its_reference_form_is_refused(fake_dist):
    """Rounded to 5 bits at its float output, each region's integers right: within 20% of the
    reference's L2 norm (the bound that let OpenVINO's UNet concat through at 33 dB vs float where
    its reference form had 53), but many times the reference form's own activation-rounding noise."""
    observed, data = _deep(fake_dist, wrong=False, model=DeepEnd(), npu=NPU.replace("OUTPUT_BITS = 8",
                                                                                      "OUTPUT_BITS = 5"))
    with torch.no_grad():
        expected = qp.convert_to_reference_fx(observed)(*data[0])
    step = float(expected.max() - expected.min()) / 31
    assert float((torch.round(expected / step) * step - expected).norm() / expected.norm()) < 0.2
    _refused_whole(observed, data, r"partition delegate_0 compiled by plugin \S*npu\S* .*broke the kernel contract "
                                   r"on the example inputs \(its outputs are off by \d+\.\dx the reference form's own "
                                   r"activation-rounding noise .*at most 2x")


@pytest.mark.parametrize("fault", ["ZERO_POINT_SHIFT", "OUTPUT_SHIFT"])
def test_a_partition_one_step_off_on_every_element_is_refused(fake_dist, fault):
    """One step off on every element is within the steps allowed for rounding, but rounding ties
    go both ways: a shift of every code the same way is a biased kernel, and was accepted. A deep
    partition's float output drifts, so it is not held to the bias rule end to end; biased beyond
    it, its regions are checked one by one, where the rule holds (a runtime one step up on every
    output, ``OUTPUT_SHIFT``, passed: a vendor's report)."""
    observed, data = _deep(fake_dist, wrong=False, model=DeepEnd(), npu=NPU.replace(f"{fault} = 0", f"{fault} = 1"))
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"int8 region \S+, compiled alone on the reference's own inputs, is within "
                                         r"1 step .*; off by \+1.00 steps on average \(at most 0.25 either way"):
        lowered = qp.convert_fx(observed)
    assert qp.quantization_report(lowered).partitions == []
    with torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))


def test_a_region_wrong_inside_a_partition_stays_in_reference_form_and_the_rest_is_compiled(fake_dist, tmp_path):
    """End to end the wrong partition still looks plausible (right shapes, cosine near 1, and a
    multi-region partition is not held to element-wise steps end to end), so only the region by
    region check at convert catches it, and names the region. Only that region is given up: the
    partition is planned again without it and the regions before and after it run compiled (a
    whole partition given up for one layer cost OpenVINO all 18 regions of Wav2Vec2's encoder).
    Loaded from a file, the model leaves the region out of its partitions again."""
    observed, data = _deep(fake_dist, wrong=True)
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"partition delegate_0 compiled by plugin \S*npu\S* .*broke "
                                         r"the kernel contract .*int8 region inner_\S+, compiled alone "
                                         r"on the reference's own inputs, is within 1 step.*; this region is "
                                         r"kept in reference form, the rest of the partition compiled without it"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert sorted(p["int8_regions"] for p in report.partitions) == [1, 2]  # conv | inner | conv3, mean
    assert set(report.kernels) == {"conv", "conv3", "mean"}
    assert "this region is kept in reference form" in report.reference["inner"] and set(report.reference) == {"inner", "fc"}
    assert not any(isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1)
                   for p in report.partitions for m in lowered.get_submodule(p["name"]).modules())
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))
    loaded = qp.load(qp.save(lowered, tmp_path / "split.safetensors"))
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), reference(*data[1]))
    assert qp.quantization_report(loaded).kernels == report.kernels


def test_a_compile_modifying_its_partition_in_the_region_check_leaves_the_model_right(fake_dist):
    """The region-by-region check compiles the partition's regions side by side: a compile zeroing
    the biases of what it was handed there zeroed the model's own (its modules are the model's)."""
    observed, data = _deep(fake_dist, wrong=True, npu=NPU.replace("MUTATE = False", "MUTATE = True"))
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"compile modified the partition it was given \(.*bias.*\); qplug put its "
                                         r"values back"):
        lowered = qp.convert_fx(observed)
    assert set(qp.quantization_report(lowered).kernels) == {"conv", "conv3", "mean"}
    with torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))


class WithNorm(nn.Module):
    """A float op (LayerNorm: no qconfig by default) between int8 convolutions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.act, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.LayerNorm([8, 8]), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.act(self.conv(x))).mean((2, 3))


def test_a_wrong_region_without_an_int8_op_is_recorded_and_loads_as_saved(fake_dist, tmp_path):
    """LayerNorm and the quantize after it are a region holding no int8 op: convert keeps it out of
    the partitions, and the file records it so that load plans around it too (it refused the file:
    a Wav2Vec2 on OpenVINO, whose check kept out the quantize after each LayerNorm)."""
    fake_dist("qplug-npu", NPU.replace("WRONG_AFTER_NORM = False", "WRONG_AFTER_NORM = True"))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 3, 8, 8, generator=g),) for _ in range(3)]
    observed = qp.calibrate(qp.prepare_fx(WithNorm().eval(), None, data[0], backend="npu"), data)
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning, match=r"int8 region act_quantize_2, compiled alone .* this region is kept"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert "act" not in report.quantized and list(report.kept_regions) == ["act_quantize_2"]
    assert sorted(p["int8_regions"] for p in report.partitions) == [1, 1]  # conv | layer norm | conv2
    loaded = qp.load(qp.save(lowered, tmp_path / "norm.safetensors"))
    assert qp.quantization_report(loaded).kernels == report.kernels
    with torch.no_grad():
        assert torch.equal(loaded(*data[1]), lowered(*data[1]))
        assert torch.equal(lowered(*data[1]), reference(*data[1]))


def test_a_right_multi_region_partition_is_kept(fake_dist):
    observed, data = _deep(fake_dist, wrong=False)
    reference = qp.convert_to_reference_fx(observed)
    with pytest.warns(UserWarning) as caught:
        lowered = qp.convert_fx(observed)
    # the one warning: the linear the SDK does not take runs in reference form (it was silent)
    assert [str(w.message) for w in caught] == [
        "qplug: 1 int8 layer(s) run in PyTorch in reference form (int8 rounding simulated in float, slower "
        "than the backend's own): 'fc' (backend 'npu' does not take Linear)"]
    report = qp.quantization_report(lowered)
    assert [p["int8_regions"] for p in report.partitions] == [4]
    assert list(report.reference) == ["fc"]  # outside the partition: the SDK does not take linears
    with torch.no_grad():
        assert torch.equal(lowered(*data[0]), reference(*data[0]))


class SizedHeads(nn.Module):
    """Sizes read on both sides of a layer the NPU does not take (the Linear), as attention
    splits heads: torch.export leaves the dynamic batch and length as ints (``sym_size``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.fc, self.conv2 = nn.Conv1d(8, 8, 3, padding=1), nn.Linear(8, 8), nn.Conv1d(4, 4, 1)

    def forward(self, x):
        batch, length, _ = x.shape
        y = self.fc(torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2).reshape(batch, length, 8))
        heads = self.conv2(y.reshape(batch * length, 2, 4).transpose(1, 2))
        return heads.transpose(1, 2).reshape(batch, length, 8) + y


@pytest.mark.parametrize("capture", ["export", "symbolic"])
def test_sizes_read_across_partitions_are_recomputed_and_every_partition_compiles(fake_dist, tmp_path, capture):
    """An SDK's graph takes and returns tensors only: ints at a partition's edge made ONNX Runtime
    and OpenVINO refuse Wav2Vec2's attention partitions ("'int' object has no attribute 'name'"),
    which then ran in reference form. Each side recomputes the sizes it reads instead."""
    fake_dist("qplug-npu", NPU)
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(2, 5, 8, generator=g) for _ in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.simplefilter("ignore", QplugPluginWarning)  # a slow import on a busy machine
        # the Linear the NPU does not take (that warning: test_a_right_multi_region_partition_is_kept)
        warnings.filterwarnings("ignore", message=r"qplug: 1 int8 layer\(s\) run in PyTorch in reference form")
        lowered = qp.quantize(SizedHeads().eval(), (data[0],), data, backend="npu", capture=capture)
    reference = qp.quantize(SizedHeads().eval(), (data[0],), data, backend="reference", capture=capture)
    report = qp.quantization_report(lowered)
    assert [p["module"] for p in report.partitions] == ["Compiled", "Compiled"]
    assert set(report.reference) == {"fc"}
    longer = torch.randn(3, 7, 8, generator=g)  # other sizes: computed on each call, not baked in
    loaded = qp.load(qp.save(lowered, tmp_path / "heads.safetensors"))
    with torch.no_grad():
        for x in (data[1], longer):
            assert torch.equal(lowered(x), reference(x))
            assert torch.equal(loaded(x), reference(x))


class Positional(nn.Module):
    """A 1x1 conv whose output stays float (no int8 sin, added to a float residual), then a LayerNorm
    quantized for the next conv, as Wav2Vec2's positional conv before the encoder's LayerNorm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.pos = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)
        self.norm, self.conv3 = nn.LayerNorm([8, 8]), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return self.conv3(self.norm(y + torch.sin(self.pos(y)))).mean((2, 3))


def test_a_wrong_layer_is_blamed_alone_not_the_regions_after_its_float_output(fake_dist):
    """Checked region by region, the quantize after the LayerNorm reads the wrong conv's float
    output as the reference computed it: OpenVINO's wrong grouped positional conv in Wav2Vec2 made
    every LayerNorm's quantize after it look 134 steps off, and kept those out of the partitions."""
    observed, data = _deep(fake_dist, wrong=True, model=Positional(),
                           npu=NPU.replace("FLOAT_OUTPUTS = frozenset()", "FLOAT_OUTPUTS = frozenset({'conv'})"))
    with pytest.warns(UserWarning, match=r"int8 region pos, compiled alone .* this region is kept"):
        lowered = qp.convert_fx(observed)
    report = qp.quantization_report(lowered)
    assert list(report.kept_regions) == ["pos"] and set(report.reference) == {"pos"}
    assert set(report.kernels) == {"conv", "conv3"}  # conv3's output stays float: no int8 mean


@pytest.mark.parametrize(("at_batch_1", "why"), [
    ("fail", r"compiling it failed \(RuntimeError: the SDK has no kernel for this op at batch 1\)"),
    ("wrong", r"the model compiled for them broke the kernel contract \(its outputs point away"),
])
def test_a_new_input_signature_whose_model_fails_or_is_wrong_runs_the_reference_form(fake_dist, at_batch_1, why):
    """A model compiled at the first call of a new batch size is held to the convert-time contract:
    OpenVINO failed to compile Mish at batch 1 after a batch-256 example (raw RuntimeError in
    production), and ONNX Runtime's batch-1 session of an FT-Transformer was off by more than the
    model's int8 error. That signature runs the reference form, with one warning, from then on."""
    fake_dist("qplug-npu", NPU.replace('AT_BATCH_1 = ""', f"AT_BATCH_1 = {at_batch_1!r}"))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    session = lowered.delegate_0
    row, three = data[1][0][:1], torch.cat([data[1][0], data[0][0][:1]])
    with pytest.warns(UserWarning) as caught, torch.no_grad():
        assert torch.equal(lowered(row), reference(row))
    assert len(caught) == 1
    assert re.fullmatch(r"qplug: backend 'npu': partition delegate_0 compiled by plugin \S*npu\S* \(qplug-npu "
                        r"0.1\) runs its reference form for inputs of \(1, 3, 6, 6\) float32: " + why + ".*",
                        str(caught[0].message))
    [record] = qp.quantization_report(lowered).partitions
    assert list(record["reference_inputs"]) == ["(1, 3, 6, 6) float32"]
    builds = type(session).builds
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert torch.equal(lowered(row), reference(row))  # decided once: no build, no check, no warning
            assert type(session).builds == builds
            assert torch.equal(lowered(three), reference(three))
    assert type(session).builds == builds + 1  # batch 3 compiled, checked and kept


@pytest.mark.parametrize("when", ["new input signature", "first call after qp.load"])
def test_a_warning_raised_while_a_partition_runs_points_at_the_user_s_call(fake_dist, tmp_path, when):
    """It pointed at torch's module call (``torch/nn/modules/module.py``) or dynamo's wrapper: the
    user could not tell which of their calls met a refused signature or a partition that failed its
    check after qp.load."""
    fake_dist("qplug-npu", NPU.replace('AT_BATCH_1 = ""', 'AT_BATCH_1 = "wrong"') if when == "new input signature"
              else NPU)
    observed, data = _quantize("npu")
    model, x = qp.convert_fx(observed), data[1][0][:1]  # batch 1: computed wrongly
    if when == "first call after qp.load":
        model, x = qp.load(qp.save(model, tmp_path / "npu.safetensors")), data[1][0]
        importlib.import_module("qplug_npu").WRONG = True  # the serving host's SDK is wrong
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        model(x)
    assert [(w.filename, w.lineno) for w in caught if "qplug: backend 'npu'" in str(w.message)] == [(__file__, line)]


@pytest.mark.parametrize("loaded", [False, True])
def test_a_compiled_partition_raising_on_a_call_answers_it_with_its_reference_form(fake_dist, tmp_path, loaded):
    """The SDK's exception reached the user raw, naming neither plugin nor partition, and a server
    failed the request. The reference form answers instead (the model answers as it would have),
    that input signature runs it from then on, and one warning and the report say so."""
    fake_dist("qplug-npu", NPU.replace("RAISES_AT_BATCH = 0", "RAISES_AT_BATCH = 3"))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    model = qp.convert_fx(observed)
    if loaded:  # compiled at its first call (batch 2), then served as at convert
        model = qp.load(qp.save(model, tmp_path / "npu.safetensors"))
        with torch.no_grad():
            model(*data[0])
    three = torch.cat([data[1][0], data[0][0][:1]])
    with pytest.warns(UserWarning) as caught, torch.no_grad():
        assert torch.equal(model(three), reference(three))
    assert [str(w.message) for w in caught if "reference form for inputs" in str(w.message)] == [
        f"qplug: backend 'npu': partition delegate_0 compiled by plugin {_npu_label()} runs its reference form for "
        "inputs of (3, 3, 6, 6) float32: its compiled model raised RuntimeError: the NPU has no kernel for batch 3"]
    report = qp.quantization_report(model)
    assert list(report.partitions[0]["reference_inputs"]) == ["(3, 3, 6, 6) float32"]
    assert ("delegate_0: reference form for (3, 3, 6, 6) float32: its compiled model raised RuntimeError: "
            "the NPU has no kernel for batch 3") in " ".join(str(report).split())  # a benchmark there measures it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            assert torch.equal(model(three), reference(three))  # decided once: no second warning
            assert torch.equal(model(*data[1]), reference(*data[1]))  # batch 2 still runs compiled


def test_a_runtime_raising_after_its_model_was_built_runs_the_reference_form_for_that_signature(fake_dist):
    """A CompiledPartition whose runtime raises on a call (after convert checked it) answers with
    its reference form, as for a signature whose model failed to build."""
    fake_dist("qplug-npu", NPU.replace('AT_BATCH_1 = ""', 'AT_BATCH_1 = "later"'))
    observed, data = _quantize("npu")
    reference = qp.convert_to_reference_fx(observed)
    lowered = qp.convert_fx(observed)
    npu = importlib.import_module("qplug_npu")
    npu.RUN_RAISES = True
    with pytest.warns(UserWarning, match=r"runs its reference form for inputs of \(2, 3, 6, 6\) float32: its "
                                         r"compiled model raised RuntimeError: the NPU lost its device"), torch.no_grad():
        assert torch.equal(lowered(*data[1]), reference(*data[1]))
    assert list(lowered.delegate_0.refused) == ["(2, 3, 6, 6) float32"]


def test_inputs_neither_the_compiled_partition_nor_its_reference_form_take_name_the_plugin(fake_dist):
    """Inputs the model cannot take: the error is qplug's, names the plugin and the partition, and
    chains the runtime's own."""
    from qplug_core.errors import DelegateRuntimeError

    fake_dist("qplug-npu", NPU)
    observed, _ = _quantize("npu")
    lowered = qp.convert_fx(observed)
    with pytest.raises(DelegateRuntimeError, match=r"^backend 'npu': partition delegate_0 compiled by plugin "
                                                   r"\S*npu\S* \(qplug-npu 0.1\) raised RuntimeError: .* on inputs of "
                                                   r"\(2, 5, 6, 6\) float32, and its reference form cannot take them "
                                                   r"either \(RuntimeError: .*\): the inputs do not fit") as raised:
        with torch.no_grad():
            lowered(torch.zeros(2, 5, 6, 6))
    assert (raised.value.partition, raised.value.dist) == ("delegate_0", "qplug-npu")
    assert isinstance(raised.value.__cause__, RuntimeError)


def _npu_label() -> str:
    from qplug_core.registry import plugins

    return plugins.collect_first("qplug_delegate", backend="npu").record.label


def test_a_wrong_partition_whose_regions_could_not_be_checked_one_by_one_is_refused_and_says_so(fake_dist):
    """The region by region check compiles a graph of its own; an SDK refusing that graph used to
    count as "no region wrong", and the wrong 1x1 convolution went in unchecked without a word.
    Its error, far beyond the reference form's own rounding noise, now refuses it as a whole, and
    the warning says its regions could not be checked one by one."""
    npu = NPU.replace("def _compile(partition, example_inputs):\n",
                      "def _compile(partition, example_inputs):\n"
                      "    if len(example_inputs) > 1:  # the region by region check's graph\n"
                      "        raise RuntimeError('the SDK takes graphs of one input')\n")
    observed, data = _deep(fake_dist, wrong=True, npu=npu)
    _refused_whole(observed, data, r"partition delegate_0 .*broke the kernel contract .*activation-rounding noise .*; "
                                   r"it was checked as a whole only: its \d+ int8 regions could not be checked one by "
                                   r"one \(RuntimeError: the SDK takes graphs")


@pytest.mark.parametrize("fail", [False, True])
def test_the_pattern_suite_fails_a_delegate_whose_compile_fails(fake_dist, fail):
    """A delegate has no kernel table: the suite expected no lowering, so a compiler that never
    worked passed every case. The nodes its support takes must now run in a compiled partition."""
    from qplug_core.testing.pattern_cases import cases_for, check_pattern

    fake_dist("qplug-npu", NPU.replace("FAIL = False", f"FAIL = {fail}"))
    case = next(c for c in cases_for("npu") if c.id == "ReLU <- Conv2d")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        result = check_pattern("npu", case)
    assert result.problems == ([f"the delegate of 'npu' takes {result.anchors} (ConvReLU2d) but they did not "
                                f"run in a compiled partition: {list(result.reference.values())}"] if fail else [])
    assert all(("SDK rejected" in why) == fail for why in result.reference.values())


def test_the_pattern_cases_of_a_backend_without_a_qat_default_skip_its_qat_cases(fake_dist):
    """An inference-only runtime has no QAT default (allowed): building the cases raised
    ConfigError at collection, and a vendor's whole test module ran nothing."""
    from qplug_core.testing.pattern_cases import cases_for

    fake_dist("qplug-npu", NPU.replace("return default_qconfig_mapping(mode) if backend == \"npu\" else None",
                                       "return default_qconfig_mapping(mode) if backend == \"npu\" and mode != \"qat\" "
                                       "else None"))
    cases = cases_for("npu")
    qat = [case for case in cases if case.make_model is None and "'qat'" in case.skip_reason]
    assert qat and all(case.skip_reason == "backend 'npu' has no default 'qat' qconfig mapping to build this QAT "
                       "case with" for case in qat)
    assert any(case.id == "ReLU <- Conv2d" and case.make_model is not None for case in cases)


def test_qplug_report_describes_a_delegate_file_without_its_plugin_from_its_reference_form(fake_dist, tmp_path,
                                                                                            monkeypatch):
    """An operator inspecting a vendor's file for a support ticket rarely has the vendor's plugin:
    ``qplug report`` failed with qp.load's "not installed" error. The header describes the recorded
    partitions without it; ``--verify`` loads the reference form."""
    from typer.testing import CliRunner

    from qplug_core.cli.app import app
    from qplug_core.registry import plugins

    fake_dist("qplug-npu", NPU)
    observed, _ = _quantize("npu")
    path = qp.save(qp.convert_fx(observed), tmp_path / "npu.safetensors")
    monkeypatch.setenv(plugins.ENV_DISABLE, "npu")
    plugins.reset()
    described = CliRunner().invoke(app, ["report", str(path), "--json"])  # from the header: no plugin needed
    assert described.exit_code == 0, described.output
    facts = json.loads(described.stdout)
    assert facts["report"]["backend"] == "npu" and "described_from" not in facts
    assert facts["report"]["kernels"] and all(k.startswith("delegate:") for k in facts["report"]["kernels"].values())
    result = CliRunner().invoke(app, ["report", str(path), "--json", "--verify"])  # loaded
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["backend"] == "npu" and facts["report"]["backend"] == "reference"
    assert facts["described_from"].startswith("its reference form, not its backend's kernels (")
    assert "backend 'npu', which is not installed" in facts["described_from"]

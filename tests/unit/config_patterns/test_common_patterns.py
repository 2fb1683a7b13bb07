"""Shared pattern configs: counts, torch.ao parity per category, fixed qparams, fuser consistency."""

from __future__ import annotations

import json
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.config import BackendConfig, DTypeConfig, DTypeWithConstraints, ObservationType
from qplug_core.config import common_patterns as common
from qplug_core.config import dtype_configs as dc
from qplug_core.config.common_patterns import common_pattern_configs
from qplug_core.config.dtype_configs import reference_dtype_configs
from qplug_core.errors import ConfigValidationError
from qplug_core.nn import intrinsic as nni
from qplug_core.nn import qat

EXPECTED_TOTAL = 255  # 249 + operator.matmul (``a @ b``), "matmul", torch.bmm, "bmm", torch.mm and "mm" (symbolic capture)
_CONVS = [(nni.CONV_BY_DIM[d], nni.BN_BY_DIM[d], getattr(F, f"conv{d}d")) for d in (1, 2, 3)]
OUR_EXTRAS = {  # deliberate additions over torch.ao (complex format): torch.relu and x.relu()
    # after linears, convs and batch norms as after nn.ReLU / F.relu; ops that run on int8 as is
    (torch.relu, nn.Linear), ("relu", nn.Linear), (torch.relu, F.linear), ("relu", F.linear),
    *((relu, op) for relu in (torch.relu, "relu") for conv, _, func in _CONVS for op in (conv, func)),
    *((relu, (bn, conv)) for relu in (torch.relu, "relu") for conv, bn, _ in _CONVS),
    *((relu, bn) for relu in (torch.relu, "relu") for bn in (nn.BatchNorm2d, nn.BatchNorm3d)),
    # linear + bn1d + relu fuses as conv + bn + relu does (torch.ao has no such fusion)
    *((relu, (nn.BatchNorm1d, nn.Linear)) for relu in common.RELU_FORMS), nni.LinearBnReLU1d, qat.LinearBnReLU1d,
    nn.Upsample, nn.UpsamplingNearest2d, nn.UpsamplingBilinear2d, nn.Flatten, "flatten", torch.relu,
    torch.clip, "clip",  # clamp's alias: share qparams as clamp does
    # a causal conv's zero padding and a TCN's chomp slice: float islands between int8 convs
    # (constant-zero pads and basic slices only: flows/exact_share.py)
    F.pad, nn.ConstantPad1d, nn.ConstantPad2d, nn.ConstantPad3d, nn.ZeroPad1d, nn.ZeroPad2d,
    nn.ZeroPad3d, operator.getitem,
    torch.chunk, torch.split, "chunk", "split",  # CSP / C2f blocks: pieces read by index (flows/split_pieces.py)
    # own-observer ops with int8 kernels: SiLU (YOLO, EfficientNet, diffusion UNets) and the
    # GroupNorm module (torch.ao lists only F.group_norm)
    nn.SiLU, F.silu, nn.GroupNorm,
    # ``a @ b``, ``a.matmul(b)``, ``torch.bmm``, ``a.bmm(b)``, ``torch.mm`` and ``a.mm(b)`` as symbolic
    # capture records them (torch.ao names torch.matmul only; torch.export records torch.matmul, torch.bmm
    # or torch.mm)
    operator.matmul, "matmul", torch.bmm, "bmm", torch.mm, "mm",
}


@pytest.fixture(scope="module")
def configs():
    return common_pattern_configs(**reference_dtype_configs())


def test_count_and_uniqueness(configs):
    patterns = [c.pattern_complex_format for c in configs]
    assert len(configs) == EXPECTED_TOTAL
    assert len(set(patterns)) == len(patterns)
    backend = BackendConfig("reference").set_backend_pattern_configs(configs)  # no duplicates
    assert BackendConfig.from_dict(json.loads(json.dumps(backend.to_dict()))) == backend


# -- torch.ao parity -------------------------------------------------------------------------------


def _to_ours(element):
    """Map torch.ao.nn.* classes in a pattern or field to qplug's classes of the same name."""
    if isinstance(element, tuple):
        return tuple(_to_ours(e) for e in element)
    module = getattr(element, "__module__", "") or ""
    if isinstance(element, type) and module.startswith("torch.ao.nn."):
        namespace = qat if ".qat" in module else nni
        return getattr(namespace, element.__name__)
    return element


def _ao_merged(ao_configs):
    """torch.ao's configs keyed by our complex pattern, duplicate registrations merged."""
    merged: dict = {}
    for config in ao_configs:
        key = _to_ours(config._pattern_complex_format if config.pattern is None
                       else _ao_complex(config.pattern))
        entry = merged.setdefault(key, {})
        for field in ("observation_type", "root_module", "qat_module", "fused_module",
                      "fuser_method", "_num_tensor_args_to_observation_type",
                      "_input_type_to_index"):
            value = getattr(config, field)
            if value not in (None, {}):
                entry[field] = value
        entry.setdefault("dtype_configs", config.dtype_configs)
    return merged


def _ao_complex(pattern):
    from torch.ao.quantization.backend_config import BackendPatternConfig
    from torch.ao.quantization.backend_config.utils import _get_pattern_in_reversed_nested_tuple_format
    return _get_pattern_in_reversed_nested_tuple_format(BackendPatternConfig(pattern))


CATEGORIES = [  # (our builder, torch.ao builder name, expected number of our configs)
    (common.conv_configs, "_get_conv_configs", 75),
    (common.linear_configs, "_get_linear_configs", 22),
    (common.binary_op_configs, "_get_binary_op_configs", 23),  # + operator.matmul, "matmul", bmm and mm forms
    (lambda d: [common.cat_config(d)], "_get_cat_config", 1),
    (common.default_op_configs, "_get_default_op_configs", 17),
    (common.fixed_qparams_op_configs, "_get_fixed_qparams_op_configs", 13),
    (common.share_qparams_op_configs, "_get_share_qparams_op_configs", 79),
    (common.tensor_info_op_configs, "_get_tensor_info_op_configs", 2),
    (common.bn_configs, "_get_bn_configs", 12),
    (common.ln_configs, "_get_ln_configs", 2),
    (common.rnn_op_configs, "_get_rnn_op_configs", 5),
    (common.embedding_op_configs, "_get_embedding_op_configs", 4),
]


@pytest.mark.parametrize("ours_fn,ao_name,count", CATEGORIES, ids=[c[1] for c in CATEGORIES])
def test_category_matches_torch_ao(ours_fn, ao_name, count):
    ao_utils = pytest.importorskip("torch.ao.quantization.backend_config._common_operator_config_utils")
    from torch.ao.quantization.backend_config import native

    ours = {c.pattern_complex_format: c for c in ours_fn([dc.weighted_op_quint8_dtype_config])}
    assert len(ours) == count
    ao_result = getattr(ao_utils, ao_name)([native.weighted_op_quint8_dtype_config])
    theirs = _ao_merged(ao_result if isinstance(ao_result, list) else [ao_result])
    assert theirs and set(theirs) <= set(ours), f"missing: {set(theirs) - set(ours)}"
    assert set(ours) - set(theirs) <= OUR_EXTRAS
    for pattern, ao in theirs.items():
        config = ours[pattern]
        assert config.observation_type.name == ao.get("observation_type").name, pattern
        for field in ("root_module", "qat_module", "fused_module"):
            assert config.__getattribute__(field) is _to_ours(ao.get(field)), (pattern, field)
        assert (config.fuser_method is None) == ("fuser_method" not in ao), pattern
        assert {k: v.name for k, v in config.num_tensor_args_to_observation_type.items()} == {
            k: v.name for k, v in ao.get("_num_tensor_args_to_observation_type", {}).items()}
        assert config.input_type_to_index == ao.get("_input_type_to_index", {})
        ours_in = config.dtype_configs[0].input_dtype_with_constraints
        ao_in = ao["dtype_configs"][0].input_dtype_with_constraints
        assert (ours_in.scale_exact_match, ours_in.zero_point_exact_match) == (
            ao_in.scale_exact_match, ao_in.zero_point_exact_match), pattern


def test_whole_set_matches_native_backend_config(configs):
    pytest.importorskip("torch.ao.quantization.backend_config.utils")
    from torch.ao.quantization.backend_config import get_native_backend_config

    theirs = {_to_ours(p) for p in get_native_backend_config()._pattern_complex_format_to_config}
    ours = {c.pattern_complex_format for c in configs}
    assert len(theirs) == EXPECTED_TOTAL - len(OUR_EXTRAS)
    assert theirs - ours == set()
    assert ours - theirs == OUR_EXTRAS


# -- fixed qparams ---------------------------------------------------------------------------------


@pytest.mark.parametrize("op,scale,zero_point", [
    (nn.Sigmoid, 1 / 256, 0), (torch.sigmoid, 1 / 256, 0), ("sigmoid_", 1 / 256, 0),
    (nn.Hardsigmoid, 1 / 256, 0), (nn.Softmax, 1 / 256, 0),
    (nn.Tanh, 2 / 256, 128), ("tanh", 2 / 256, 128),
])
def test_fixed_qparams(configs, op, scale, zero_point):
    config = next(c for c in configs if c.pattern_complex_format is op)
    for dtype_config in config.dtype_configs:
        for act in (dtype_config.input_dtype_with_constraints,
                    dtype_config.output_dtype_with_constraints):
            assert act.dtype == torch.quint8
            assert (act.scale_exact_match, act.zero_point_exact_match) == (scale, zero_point)
            assert (act.quant_min_lower_bound, act.quant_max_upper_bound) == (0, 255)
            assert not act.violations(torch.quint8, 0, 255, scale, zero_point)


def test_fixed_qparams_leave_other_dtypes_and_reject_scale_bounds():
    int8 = DTypeConfig(input_dtype=torch.qint8, output_dtype=torch.qint8)
    (kept,) = common.fixed_qparams_dtype_configs([int8], common.FIXED_QPARAMS_CONSTRAINTS[nn.Tanh])
    assert kept == int8
    bounded = DTypeConfig(input_dtype=DTypeWithConstraints(torch.quint8, scale_min_lower_bound=1e-5),
                          output_dtype=torch.quint8)
    with pytest.raises(ConfigValidationError, match="scale_min_lower_bound"):
        common.fixed_qparams_op_configs([bounded])


# -- internal consistency --------------------------------------------------------------------------


def test_binary_ops_observation_by_tensor_args(configs):
    add = next(c for c in configs if c.pattern_complex_format is torch.add)
    mapping = add.num_tensor_args_to_observation_type
    assert mapping[1] is ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT
    assert mapping[2] is ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT


def _module_for(element, channels=4):
    if element in nni.CONV_BY_DIM.values() or element in (nn.ConvTranspose1d, nn.ConvTranspose2d,
                                                           nn.ConvTranspose3d):
        return element(3, channels, 3)
    if element is nn.Linear:
        return element(3, channels)
    if element in nni.BN_BY_DIM.values():
        return element(channels)
    return element() if isinstance(element, type) else element


def test_every_fusion_config_builds_its_fused_module(configs):
    """The fuser of each fusion config, called as the fuse pass calls it, gives fused_module."""
    fusions = [c for c in configs if c.fuser_method is not None]
    assert len(fusions) == 3 * 10 + 9 + 8  # conv (relu x4, bn, bn-relu x4, convT-bn), linear (relu x4, bn,
    # bn-relu x4), bn-relu x4
    for config in fusions:
        modules = [_module_for(e) for e in config.pattern]
        for is_qat in (True, False):
            for m in modules:
                if isinstance(m, nn.Module):
                    m.train(is_qat)
            if is_qat and config.fuser_method is common.fm.fuse_convtranspose_bn:
                continue
            fused = config.fuser_method(is_qat, *modules)
            if is_qat and config.fused_module is not None:
                assert type(fused) is config.fused_module, config.pattern
            assert isinstance(fused, nn.Module)


def test_reference_dtype_configs_shape():
    kwargs = reference_dtype_configs()
    assert dc.default_dynamic_int8_dtype_config in kwargs["linear_dtype_configs"]
    assert dc.default_dynamic_float16_dtype_config in kwargs["rnn_op_dtype_configs"]
    assert kwargs["embedding_op_dtype_configs"] == [dc.weight_only_quint8_dtype_config]
    linear = next(c for c in common_pattern_configs(**kwargs) if c.pattern_complex_format is nn.Linear)
    assert len(linear.dtype_configs) == 3

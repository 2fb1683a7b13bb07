"""``plugin_api.kernel_table``: a vendor's kernels keyed by op family over the shared pattern set,
every spelling included, the same keys as qplug's own torch kernel table gives those families."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qplug_core.nn import intrinsic
from qplug_core.plugin_api import (
    DTypeConfigSet,
    KernelSpec,
    default_op_quint8_dtype_config,
    kernel_table,
    torch_int8_kernels,
    weighted_op_quint8_dtype_config,
)

CONFIGS = DTypeConfigSet(weighted_op=(weighted_op_quint8_dtype_config,),
                         default_op=(default_op_quint8_dtype_config,)).pattern_configs()
SPECS = {family: KernelSpec(f"vendor::{family}", build=nn.Identity)
         for family in ("conv2d", "linear", "add", "add_relu", "mul", "mul_relu", "relu")}


@pytest.fixture(scope="module")
def table():
    return kernel_table(CONFIGS, weighted={nn.Conv2d: SPECS["conv2d"], nn.Linear: SPECS["linear"]},
                        **{f: SPECS[f] for f in ("add", "add_relu", "mul", "mul_relu", "relu")})


def _keys(table: dict, op: str) -> set:
    return {pattern for pattern, spec in table.items() if spec.op == op}


@pytest.mark.parametrize("family, torch_op", [
    ("conv2d", "quantized::conv2d"), ("linear", "quantized::linear"), ("add", "quantized::add"),
    ("add_relu", "quantized::add_relu"), ("mul", "quantized::mul"), ("mul_relu", "quantized::mul_relu")])
def test_same_keys_as_the_torch_kernel_table(table, family, torch_op):
    torch_table = torch_int8_kernels([c.pattern_complex_format for c in CONFIGS], "fbgemm")
    assert _keys(table, f"vendor::{family}") == _keys(torch_table, torch_op) != set()


def test_every_spelling_of_a_family_is_keyed(table):
    for relu in (nn.ReLU, F.relu, torch.relu):
        for add in (operator.add, torch.add):
            assert table[(relu, add)] is SPECS["add_relu"]
    for fused in (intrinsic.ConvReLU2d, intrinsic.ConvBnReLU2d, nn.Conv2d):
        assert table[fused] is SPECS["conv2d"]
    assert table[intrinsic.LinearReLU] is SPECS["linear"]
    assert {table[r].op for r in (nn.ReLU, F.relu, torch.relu, "relu")} == {"vendor::relu"}
    assert nn.Conv1d not in table and (nn.ReLU, nn.Conv2d) not in table  # a fusion has no kernel


def test_one_spec_for_every_weighted_class():
    table = kernel_table(CONFIGS, weighted=SPECS["linear"])
    assert {nn.Linear, nn.Conv1d, nn.ConvTranspose2d, intrinsic.ConvBnReLU2d} <= set(table)
    assert set(spec.op for spec in table.values()) == {"vendor::linear"}

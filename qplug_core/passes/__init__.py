"""Graph passes over torch.fx GraphModules and the PassManager that schedules them."""

from __future__ import annotations

from qplug_core.passes.base import PassBase, PassResult
from qplug_core.passes.constant_folding import ConstantFoldingPass
from qplug_core.passes.dce import dead_code_elimination
from qplug_core.passes.decompose import DecomposePass
from qplug_core.passes.manager import PassManager, pass_name, this_before_that_pass_constraint
from qplug_core.passes.remove_noops import RemoveNoOpsPass
from qplug_core.passes.replace_op import ReplaceOpPass
from qplug_core.passes.rewrite import ReplacedPatterns, replace_pattern
from qplug_core.passes.scalar_to_tensor import ScalarToTensorPass
from qplug_core.passes.transformer import MetaTransformer, TransformerPass

__all__ = [
    "ConstantFoldingPass", "DecomposePass", "MetaTransformer", "PassBase", "PassManager",
    "PassResult", "RemoveNoOpsPass", "ReplaceOpPass", "ReplacedPatterns", "ScalarToTensorPass",
    "TransformerPass", "dead_code_elimination", "pass_name", "replace_pattern",
    "this_before_that_pass_constraint",
]

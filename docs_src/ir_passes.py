"""The IR at two levels, a PassManager run, and subgraph rewriting with replace_pattern."""

import torch
from torch import fx, nn

from qplug_core.ir import capture_aten, capture_module
from qplug_core.passes import (
    PassManager,
    PassResult,
    RemoveNoOpsPass,
    dead_code_elimination,
    replace_pattern,
    this_before_that_pass_constraint,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        y = torch.relu(self.linear(x))
        return self.dropout(torch.sigmoid(y))


model = Net().eval()
x = torch.randn(2, 4)

# Symbolic capture: module calls stay call_module nodes (what the quantization flows use).
symbolic = capture_module(model)
print([n.op for n in symbolic.graph.nodes])
# ['placeholder', 'call_module', 'call_function', 'call_function', 'call_module', 'output']

# ATen capture (torch.export): every op is torch.ops.aten.*, parameters are get_attr nodes.
aten = capture_aten(model, (x,))
print(sorted({str(n.target) for n in aten.graph.nodes if n.op == "call_function"}))
torch.testing.assert_close(aten(x), model(x))


# A pass is any callable taking a GraphModule; return a PassResult to say whether it changed it.
def sigmoid_to_hardsigmoid(gm: fx.GraphModule) -> PassResult:
    modified = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.sigmoid:
            node.target = torch.nn.functional.hardsigmoid
            modified = True
    gm.recompile()
    return PassResult(gm, modified)


remove_noops = RemoveNoOpsPass()  # drops eval-mode dropout, detach, nn.Identity
manager = PassManager(
    [dead_code_elimination, sigmoid_to_hardsigmoid, remove_noops],
    constraints=[this_before_that_pass_constraint(remove_noops, dead_code_elimination)],
    steps=3,  # repeat until no pass reports modified=True (at most 3 rounds)
    run_checks_after_each_pass=True,
)
result = manager(symbolic)  # works on a copy: `symbolic` itself is unchanged
print(result.graph_module.code)  # no dropout, hardsigmoid instead of sigmoid
assert result.modified and "dropout" not in result.graph_module.code


# Subgraph rewriting: every match of `pattern` becomes `replacement` (same inputs, same outputs).
def pattern(x):
    return torch.relu(x)


def replacement(x):
    return torch.clamp(x, min=0.0)


gm = capture_module(model)
replaced = replace_pattern(gm, pattern, replacement)
print(len(replaced), "replaced")
assert torch.clamp in [n.target for n in gm.graph.nodes]
torch.testing.assert_close(gm(x), model(x))

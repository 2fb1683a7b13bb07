"""Group the nodes a backend supports into submodules; and what a backend runs in int8."""

import operator

import torch
from torch import nn

from qplug_core.analysis import by_backend
from qplug_core.ir import capture_aten
from qplug_core.partition import (
    CapabilityBasedPartitioner,
    OperatorSupport,
    OpSupports,
    chain,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.fc1(x)) + x
        z = torch.sin(y)  # unsupported: splits the graph in two
        return self.fc2(z) * 2


model = Net().eval()
x = torch.randn(2, 8)
gm = capture_aten(model, (x,))

# Which ops are supported: by target (or its qualified name); None means any dtype.
aten = torch.ops.aten
support = chain(
    OperatorSupport({aten.linear.default: None, aten.relu.default: None, aten.add.Tensor: None,
                     aten.mul.Tensor: None, operator.getitem: None}),
    OpSupports.decline_if_input_dtype(torch.float64),
)
partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=False)
partitions = partitioner.propose_partitions()
print([sorted(n.name for n in p.nodes) for p in partitions])
# [['linear_1', 'mul'], ['add', 'linear', 'relu']]

fused = partitioner.fuse_partitions(partitions)  # each partition becomes a call_module
print(sorted(n.target for n in fused.graph.nodes if str(n.target).startswith("fused_")))
# ['fused_0', 'fused_1']
torch.testing.assert_close(fused(x), model(x))

# The same question for quantization: what would this backend run in int8, and why not the rest?
split = by_backend(model, "reference", (x,))
print(split.int8_nodes)  # ['fc1', 'fc2'] (fc1 is linear+relu after fusion)
for node, reason in split.float_nodes.items():
    print(f"float: {node}: {reason}")

"""Every matching rule of qplug's matcher, each shown on a tiny traced graph."""

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from qplug_core.config import BackendConfig, BackendPatternConfig
from qplug_core.errors import DuplicatePatternError
from qplug_core.matcher import find_matches, is_match
from qplug_core.patterns import MatchAllNode


def graph_of(module):
    gm = fx.symbolic_trace(module)
    return gm, dict(gm.named_modules()), {n.name: n for n in gm.graph.nodes}


class ConvReLU(nn.Module):
    def __init__(self, conv=nn.Conv2d):
        super().__init__()
        self.conv, self.relu = conv(3, 3, 1), nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x))


# Module classes compare the exact type: a subclass does not match.
class MyConv(nn.Conv2d):
    pass


gm, modules, nodes = graph_of(ConvReLU())
assert is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))
gm, modules, nodes = graph_of(ConvReLU(MyConv))
assert not is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))


# Inner nodes may have only one user: a conv whose output is also returned is not absorbed.
class ConvUsedTwice(ConvReLU):
    def forward(self, x):
        y = self.conv(x)
        return self.relu(y), y


gm, modules, nodes = graph_of(ConvUsedTwice())
assert not is_match(modules, nodes["relu"], (nn.ReLU, nn.Conv2d))
assert is_match(modules, nodes["relu"], (nn.ReLU, MatchAllNode))  # MatchAllNode ignores users


# nn.ReLU, F.relu, torch.relu and "relu" (x.relu()) are four different patterns.
class FourReLUs(nn.Module):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(x), F.relu(x), torch.relu(x), x.relu()


gm, modules, nodes = graph_of(FourReLUs())
assert [is_match(modules, nodes["relu_1"], p) for p in (nn.ReLU, F.relu, torch.relu, "relu")] \
    == [False, True, False, False]
assert is_match(modules, nodes["relu_3"], "relu")  # the method call


# kwargs are ignored; the number of positional args must equal the number of sub-patterns.
class Add(nn.Module):
    def forward(self, x, y):
        return torch.add(x, y, alpha=2), x.shape[0]


gm, modules, nodes = graph_of(Add())
assert is_match(modules, nodes["add"], (torch.add, MatchAllNode, MatchAllNode))
assert not is_match(modules, nodes["add"], (torch.add, MatchAllNode))
# getattr patterns compare the attribute name; literals compare with ==.
assert is_match(modules, nodes["getitem"], (operator.getitem, (getattr, "shape"), 0))
assert not is_match(modules, nodes["getitem"], (operator.getitem, (getattr, "shape"), 1))


# find_matches: walk backwards, first pattern (in priority order) wins, no backtracking.
# MatchAllNode inputs are not members: conv1 -> relu1 is still fused by its own pattern.
class ResidualTail(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.relu1 = nn.Conv2d(3, 3, 1), nn.ReLU()
        self.conv2, self.bn2, self.relu2 = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()

    def forward(self, x):
        y = self.relu1(self.conv1(x))
        return self.relu2(self.bn2(self.conv2(y)) + y)


gm, modules, nodes = graph_of(ResidualTail())
tail = (nn.ReLU, (operator.add, (nn.BatchNorm2d, nn.Conv2d), MatchAllNode))
matches = find_matches(gm, [tail, (nn.ReLU, nn.Conv2d)])
assert matches["relu2"].pattern == tail and matches["relu1"].pattern == (nn.ReLU, nn.Conv2d)
assert [n.name for n in matches["relu2"].nodes] == ["relu2", "add", "bn2", "conv2"]
assert [n.name for n in matches["relu2"].inputs] == ["relu1"]
# The root (what a fuser builds on) skips MatchAllNode inputs: conv2, not relu1.
assert matches["relu2"].root.name == "conv2"

# Registering the same pattern twice is an error, not a silent overwrite.
config = BackendConfig("mine").set_backend_pattern_config(BackendPatternConfig(nn.Linear))
try:
    config.set_backend_pattern_config(BackendPatternConfig(nn.Linear))
except DuplicatePatternError as error:
    print(error)
config.set_backend_pattern_config(BackendPatternConfig(nn.Linear), replace=True)  # explicit

"""The two pattern formats, converting between them, and validation errors."""

import operator

from torch import nn

from qplug_core.errors import PatternError
from qplug_core.patterns import (
    MatchAllNode,
    format_pattern,
    sort_patterns,
    to_complex_format,
    to_simple_format,
    validate_pattern,
)

# Simple (forward) format: dataflow order, 1 to 3 single operators.
assert to_complex_format(nn.Conv2d) == nn.Conv2d
assert to_complex_format((nn.Conv2d, nn.ReLU)) == (nn.ReLU, nn.Conv2d)
assert to_complex_format((nn.Conv2d, nn.BatchNorm2d, nn.ReLU)) == \
    (nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))
assert to_simple_format((nn.ReLU, (nn.BatchNorm2d, nn.Conv2d))) == \
    (nn.Conv2d, nn.BatchNorm2d, nn.ReLU)

# Complex (reversed nested) format: anchor first, then one sub-pattern per positional arg.
resnet_tail = (nn.ReLU, (operator.add, MatchAllNode, (nn.BatchNorm2d, nn.Conv2d)))
print(format_pattern(resnet_tail))  # ReLU <- operator.add(*, BatchNorm2d <- Conv2d)

# Branches and wildcards have no simple form; the error says why.
try:
    to_simple_format(resnet_tail)
except PatternError as error:
    print(error)  # No simple form: the anchor has 2 argument sub-patterns (a branch) at position (1,) ...

# Malformed patterns are rejected when registered, with the position of the bad element.
for bad in [(nn.ReLU, nn.Conv2d(3, 3, 1)), [nn.Conv2d, nn.ReLU], MatchAllNode]:
    try:
        validate_pattern(bad)
    except PatternError as error:
        print(error)

# Matching order: tuple patterns before single ops, larger tuples first, ties keep their order.
print([format_pattern(p) for p in sort_patterns([nn.ReLU, (nn.ReLU, nn.Conv2d), resnet_tail])])
# ['ReLU <- operator.add(*, BatchNorm2d <- Conv2d)', 'ReLU <- Conv2d', 'ReLU']

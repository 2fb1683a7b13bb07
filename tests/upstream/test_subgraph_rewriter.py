"""Port of PyTorch's ``test/fx/test_subgraph_rewriter.py`` (TestSubgraphRewriter).

Translation: ``torch.fx.subgraph_rewriter.replace_pattern`` -> ``qp.passes.replace_pattern``;
``replace_pattern_with_filters(gm, p, r, filters)`` -> ``qp.passes.replace_pattern(gm, p, r,
match_filters=filters)``; ``self.assertEqual`` on tensors -> ``torch.testing.assert_close``;
``assertExpectedInline`` on code -> the same string compared with ``==``.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx import symbolic_trace

import qplug_core as qp

replace_pattern = qp.passes.replace_pattern


@torch.fx.wrap
def wrapped_gemm_bias_mul(a, b, bias):
    lin_res = torch.nn.functional.linear(a, b, bias=bias)
    mul_res = lin_res * a
    return lin_res, mul_res


@torch.fx.wrap
def wrapped_gemm_bias_mul_with_c(a, b, bias, c):
    lin_res = torch.nn.functional.linear(a, b, bias=bias)
    mul_res = lin_res * c
    return lin_res, mul_res


def _check(traced, comparison_fn, *inputs):
    traced.graph.lint()
    torch.testing.assert_close(traced.forward(*inputs), comparison_fn(*inputs))


def test_subgraph_rewriter_preserves_logic():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    def pattern(x):
        return torch.neg(x) + torch.relu(x)

    def comparison(x):
        val = torch.neg(x) + torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, pattern)
    _check(traced, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_with_oneliner_pattern():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x)
            return torch.add(val, val)

    def pattern(x):
        return torch.neg(x)

    def replacement(x):
        return torch.relu(x)

    def comparison(x):
        val = torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_single_pattern_match():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    def pattern(x):
        return torch.neg(x) + torch.relu(x)

    def replacement(x):
        return torch.relu(x)

    def comparison(x):
        val = torch.relu(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.rand(1, 3))


def test_subgraph_rewriter_multiple_pattern_match():
    class M(torch.nn.Module):
        def forward(self, x, w1, w2):
            m1 = torch.cat([w1, w2]).sum()
            m2 = torch.cat([w1, w2]).sum()
            return x + torch.max(m1) + torch.max(m2)

    def pattern(w1, w2):
        return torch.cat([w1, w2]).sum()

    def replacement(w1, w2):
        return torch.stack([w1, w2])

    def comparison(x, w1, w2):
        m1 = torch.stack([w1, w2])
        m2 = torch.stack([w1, w2])
        return x + torch.max(m1) + torch.max(m2)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.rand(1, 3), torch.rand(1, 3), torch.rand(1, 3))


def test_subgraph_rewriter_graph_argument_order():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.mm(x, y)

    def pattern(x, y):
        return torch.mm(x, y)

    def comparison(x, y):
        return torch.mm(x, y)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, pattern)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4), torch.randn(4, 5))


def test_subgraph_rewriter_correct_output_replacement():
    class M(torch.nn.Module):
        def forward(self, x, y):
            val = torch.neg(y) + torch.relu(x)
            return torch.add(val, val)

    def pattern(x):
        return torch.relu(x)

    def replacement(x):
        return torch.neg(x)

    def comparison(x, y):
        val = torch.neg(y) + torch.neg(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(4, 4), torch.randn(4, 4))


def test_subgraph_rewriter_traced_as_callable():
    class M(torch.nn.Module):
        def forward(self, x):
            val = torch.neg(x) + torch.relu(x)
            return torch.add(val, val)

    class Pattern(torch.nn.Module):
        def forward(self, x):
            return torch.neg(x) + torch.relu(x)

    class Replacement(torch.nn.Module):
        def forward(self, x):
            return torch.sigmoid(x)

    def comparison(x):
        val = torch.sigmoid(x)
        return torch.add(val, val)

    traced = symbolic_trace(M())
    replace_pattern(traced, symbolic_trace(Pattern()), symbolic_trace(Replacement()))
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_pattern_is_entire_graph():
    class M(torch.nn.Module):
        def forward(self, x):
            a = torch.neg(x)
            return torch.add(a, a)

    def pattern(x):
        a = torch.neg(x)
        return torch.add(a, a)

    def replacement(x):
        a = torch.sigmoid(x)
        return torch.cat([a, a])

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(replacement), torch.randn(3, 4))


def test_subgraph_rewriter_pattern_output_pattern_node_can_have_users_that_are_not_matched():
    class M(torch.nn.Module):
        def forward(self, x):
            y = torch.relu(x)
            return torch.neg(y) - y

    def pattern(x):
        return torch.relu(x)

    def replacement(x):
        return torch.sigmoid(x)

    def comparison(x):
        y = torch.sigmoid(x)
        return torch.neg(y) - y

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_internal_pattern_nodes_cannot_have_users_that_are_not_matched():
    class M(torch.nn.Module):
        def forward(self, x, w1, w2, b1, b2):
            m0 = torch.cat([w1, w2])  # noqa: F841 (upstream keeps it)
            m1 = torch.cat([w1, w2])
            m2 = torch.cat([x, b2])
            t0 = torch.addmm(b1, m1, m2.t())  # noqa: F841
            t1 = torch.sum(w1, 1)
            t2 = torch.addmm(b1, m1, m2.t())
            return torch.sum(t1), torch.sum(t2)

    def pattern(x, w1, w2, b1, b2):
        m1 = torch.cat([w1, w2])
        m2 = torch.cat([x, b2])
        return torch.addmm(b1, m1, m2.t())

    def replacement(x, w1, w2, b1, b2):
        return torch.cat([x, w1, w2])

    traced = symbolic_trace(M())
    res = replace_pattern(traced, pattern, replacement)
    traced.graph.lint()
    assert res == []  # no matches can be found


def test_subgraph_rewriter_placeholder_matching():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dtype = torch.float16

        def forward(self, x):
            x += 3
            x = x.dequantize()
            x = torch.sigmoid(x)
            dtype = self.dtype
            x = x.to(dtype)
            return x

    def pattern(x):
        x = x.dequantize()
        x = torch.sigmoid(x)
        x = x.to(torch.float16)
        return x

    def replacement(x):
        return x

    def comparison(x):
        return x + 3

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replaces_referenced_submodules():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            x = x + 1
            return self.submod(self.sigmoid(x))

    class Pattern(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.sigmoid = torch.nn.Sigmoid()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            return self.submod(self.sigmoid(x))

    class Replacement(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tanh = torch.nn.Tanh()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            return self.submod(self.tanh(x))

    class Comparison(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tanh = torch.nn.Tanh()
            self.submod = torch.nn.ReLU()

        def forward(self, x):
            x = x + 1
            return self.submod(self.tanh(x))

    traced = symbolic_trace(M())
    replace_pattern(traced, Pattern(), Replacement())
    _check(traced, Comparison(), torch.randn(3, 4))
    traced.get_submodule("tanh")
    with pytest.raises(AttributeError, match="has no attribute"):
        traced.get_submodule("sigmoid")
    assert type(traced.get_submodule("submod")) is torch.nn.ReLU


@pytest.mark.skip(reason="no qplug equivalent by design: tests torch.fx's RewritingTracer and "
                         "annotate(), not the rewriter; qplug ships no tracer of its own")
def test_subgraph_rewriter_annotations_int():
    """Upstream traces with torch.fx.experimental.rewriter.RewritingTracer (see docs/migrating.md)."""


def test_subgraph_rewriter_replace_consecutive_submodules():
    def f(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return torch.sigmoid(x)

    def pattern(x):
        return torch.sigmoid(x)

    def replacement(x):
        return torch.exp(x)

    def comparison(x):
        x = torch.exp(x)
        x = torch.exp(x)
        return torch.exp(x)

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_with_overlapping_matches():
    def f(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return torch.sigmoid(x)

    def pattern(x):
        x = torch.sigmoid(x)
        x = torch.sigmoid(x)
        return x

    def replacement(x):
        return torch.neg(x)

    def comparison(x):
        x = torch.neg(x)
        return torch.neg(x)

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replace_with_multiple_outputs():
    def f(x):
        y = torch.sigmoid(x)
        z = torch.relu(x)
        return y + z

    def pattern(a):
        b = torch.sigmoid(a)
        c = torch.relu(a)
        return b, c

    def replacement(x):
        return torch.exp(x), torch.abs(x)

    def comparison(x):
        y = torch.exp(x)
        z = torch.abs(x)
        return y + z

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4))


def test_subgraph_rewriter_replace_with_duplicated_outputs():
    def f(x1, x2):
        x = x1 - x2
        y = torch.sigmoid(x)
        z = torch.relu(x)
        return y + z

    def pattern(a1, a2):
        a = a1 - a2
        b = torch.sigmoid(a)
        c = torch.relu(a)
        return b, c, a

    def replacement(x1, x2):
        y1 = torch.exp(x1)
        y2 = torch.abs(x2)
        return y2, y2, y1

    def comparison(x1, x2):
        y2 = torch.abs(x2)
        return y2 + y2

    traced = symbolic_trace(f)
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4), torch.randn(3, 4))


def test_subgraph_rewriter_with_unused_args():
    class M(torch.nn.Module):
        def forward(self, x, y, z):
            return x + y

    def pattern(x, y):
        return x + y

    def replacement(x, y):
        return x - y

    def comparison(x1, x2, x3):
        return x1 - x2

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    traced.graph.lint()
    assert len([n for n in traced.graph.nodes if n.op == "placeholder"]) == 3
    _check(traced, symbolic_trace(comparison), torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))


def test_subgraph_rewriter_call_method():
    class M(torch.nn.Module):
        def forward(self, x):
            x = x.dequantize()
            x = x.sigmoid()
            x = x.to(torch.float16)
            return x

    def pattern(x):
        x = x.dequantize()
        x = x.sigmoid()
        x = x.to(torch.float16)
        return x

    def replacement(x):
        return x

    traced = symbolic_trace(M())
    replace_pattern(traced, pattern, replacement)
    _check(traced, symbolic_trace(replacement), torch.randn(3, 4))


def test_subgraph_rewriter_nodes_with_kwargs():
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w0 = torch.nn.Parameter(torch.empty([128, 128]))
            self.b0 = torch.nn.Parameter(torch.empty([128]))

        def forward(self, in0):
            lin_res = torch.nn.functional.linear(in0, self.w0, bias=self.b0)
            mul_res = in0 * lin_res
            sum_res = mul_res + in0
            return sum_res

    def pattern(a, b, bias):
        lin_res = torch.nn.functional.linear(a, b, bias=bias)
        mul_res = a * lin_res
        return lin_res, mul_res

    def replacement(a, b, bias):
        lin_res, mul_res = wrapped_gemm_bias_mul(a, b, bias)
        return lin_res, mul_res

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, pattern, replacement)
    assert len(matches) == 1
    assert any(node.target == wrapped_gemm_bias_mul for node in traced.graph.nodes)


def test_subgraph_rewriter_local_revert():
    # 3 anchors are candidates; 1 and 3 are real matches, 2 is not (its partial match is reverted)
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(5):
                setattr(self, f"w{i}", torch.nn.Parameter(torch.empty([128, 128])))
                setattr(self, f"b{i}", torch.nn.Parameter(torch.empty([128])))

        def forward(self, in0, in1):
            lin_res_1 = torch.nn.functional.linear(in1, self.w0, bias=self.b0)
            lin_res_2 = torch.nn.functional.linear(lin_res_1, self.w1, bias=self.b1)
            mul_res_1 = in1 * lin_res_2
            sum_res_1 = mul_res_1 + in1
            lin_res_3 = torch.nn.functional.linear(sum_res_1, self.w2, bias=self.b2)
            sigmoid_res_1 = torch.sigmoid(lin_res_3)
            mul_res_2 = lin_res_3 * sigmoid_res_1
            lin_res_4 = torch.nn.functional.linear(in0, self.w3, bias=self.b3)
            lin_res_5 = torch.nn.functional.linear(lin_res_4, self.w4, bias=self.b4)
            mul_res_3 = in0 * lin_res_5
            sum_res_2 = mul_res_3 + in0
            return torch.cat([mul_res_2, sum_res_2], dim=1)

    def gemm_bias_mul_pattern_with_c(a, b, bias, c):
        lin_res = torch.nn.functional.linear(a, b, bias=bias)
        mul_res = c * lin_res
        return lin_res, mul_res

    def gemm_bias_mul_replacement_with_c(a, b, bias, c):
        lin_res, mul_res = wrapped_gemm_bias_mul_with_c(a, b, bias, c)
        return lin_res, mul_res

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, gemm_bias_mul_pattern_with_c, gemm_bias_mul_replacement_with_c)
    assert len(matches) == 2
    assert sum(node.target == wrapped_gemm_bias_mul_with_c for node in traced.graph.nodes) == 2


def test_replace_pattern_with_filters():
    class M(torch.nn.Module):
        def forward(self, x, scale, zero_point):
            # Match, second input to add is a scalar
            x = x.dequantize()
            x = torch.add(x, 2)
            x = x.relu()
            x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
            y = x + 1
            # NOT a match, second input to add is NOT a scalar
            x = x.dequantize()
            x = torch.add(x, y)
            x = x.relu()
            x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
            return x

    def BinaryOpScalarReLUPattern(x, num, scale, zero_point):
        x = x.dequantize()
        x = torch.add(x, num)
        x = x.relu()
        x = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
        return x

    def BinaryOpScalarReLUReplacement(x, num, scale, zero_point):
        x = torch.mul(x, num)
        return x

    def second_input_is_scalar(match, original_graph, pattern_graph):
        input_idx = 0
        for node in pattern_graph.nodes:
            if node.op == "placeholder":
                if input_idx == 1:
                    num_node = node
                input_idx += 1
        return isinstance(match.nodes_map[num_node], (int, float))

    def check_replacement_nodes(traced, matches):
        in_graph = [node for node in traced.graph.nodes if node.target == torch.mul]
        in_res = [r for m in matches for r in m.replacements]
        assert len(in_graph) == len(in_res)
        assert in_graph == in_res
        return len(in_graph)

    traced = symbolic_trace(M())  # without filter: 2 matches
    matches = replace_pattern(traced, BinaryOpScalarReLUPattern, BinaryOpScalarReLUReplacement, None)
    assert len(matches) == 2
    assert check_replacement_nodes(traced, matches) == 2

    traced = symbolic_trace(M())  # with the filter: 1 match
    matches = replace_pattern(traced, BinaryOpScalarReLUPattern, BinaryOpScalarReLUReplacement,
                              match_filters=[second_input_is_scalar])
    assert len(matches) == 1
    assert check_replacement_nodes(traced, matches) == 1


def test_matching_pattern_with_list_type_arg():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.ops.aten._reshape_alias_copy.default(x, [1, 2], [3, 4])

    def pattern(x, arg0, arg1):
        return torch.ops.aten._reshape_alias_copy.default(x, arg0, arg1)

    def replacement(x, arg0, arg1):
        return torch.ops.aten._reshape_alias_copy.default(x, arg1, arg0)

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, pattern, replacement)
    assert len(matches) == 1
    assert traced.code.strip() == (  # upstream's assertExpectedInline
        "def forward(self, x):\n"
        "    _reshape_alias_copy_default_1 = torch.ops.aten._reshape_alias_copy.default(x, [3, 4], [1, 2]);  x = None\n"  # noqa: E501
        "    return _reshape_alias_copy_default_1")


def test_replacement_with_attrs():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.tensor([1])
            self.b = torch.tensor([2])

        def forward(self, x):
            return x + self.a - self.b

    class Pattern(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.tensor([1])

        def forward(self, x):
            return x + self.a

    class Replacement(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.tensor([3])

        def forward(self, x):
            return x - self.c

    traced = symbolic_trace(M())
    matches = replace_pattern(traced, Pattern(), Replacement())
    assert len(matches) == 1

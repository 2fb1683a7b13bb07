"""ONNX Runtime's u8 x s8 product, for ``qplug doctor``'s int16 pair-sum probe.

``MatMulInteger`` runs MLAS's U8S8 GEMM, the kernel the QLinear and fused ops of compiled
partitions use; the probe runs it in a session built with this plugin's settings.
"""

from __future__ import annotations

import numpy as np
import torch

from qplug_onnxruntime.session import settings


def matmul_integer(codes: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``codes @ weights.T`` as ORT's ``MatMulInteger`` computes it (int32)."""
    import onnx
    from onnx import TensorProto, helper

    weight_t = weights.t().contiguous().numpy()
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "pair_sum_probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, list(codes.shape))],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [codes.shape[0], weights.shape[0]])],
        [helper.make_tensor("b", TensorProto.INT8, list(weight_t.shape), weight_t.tobytes(), raw=True)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    session = settings().inference_session(model.SerializeToString())
    (out,) = session.run(None, {"a": np.ascontiguousarray(codes.numpy())})
    return torch.from_numpy(out)

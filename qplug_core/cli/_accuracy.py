"""How close an int8 model answers to its float original, as the commands print it.

Output SQNR and cosine say how much int8 changed the answer; the worst layers say where. Layers are
compared against the *fused* float model (``qp.fuse_fx``) so that a conv+bn+relu kernel meets the
float conv+bn+relu, not the bare conv.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from qplug_core.cli._common import number
from qplug_core.cli._table import new_table

if TYPE_CHECKING:
    from torch import nn

WORST_LAYERS = 5


def accuracy_document(float_model: nn.Module, qmodel: nn.Module, batches: list[tuple], *,
                      backend: Any, evaluated_on: str, fuse: bool = True,
                      layers: set[str] | None = None) -> dict[str, Any]:
    """Output SQNR/cosine over ``batches`` and the worst layers, JSON-safe; ``layers`` limits them to
    the quantized ones (a W8A8 model's norms differ from float by design: SmoothQuant folded
    scales into them)."""
    import qplug_core as qp
    from qplug_core.errors import QplugError
    from qplug_core.flows.pipeline import eval_mode

    reference, compared_against = float_model, "float model"
    if fuse:
        try:  # post-training quantization fused the model in eval mode: so does this (on its own copy)
            with eval_mode(float_model), warnings.catch_warnings():
                # the quantize call captured the same model and said it all: the CLI printed its
                # capture warning twice, the second one naming the comparison's one batch
                warnings.filterwarnings("ignore", message="qplug:")
                reference = qp.fuse_fx(float_model, batches[0], backend=backend)
            compared_against = "fused float model (qp.fuse_fx)"
        except QplugError:  # not capturable: the outputs still compare, layer pairs are coarser
            pass
    comparison = qp.compare(reference, qmodel, batches)
    return {"evaluated_on": evaluated_on, "batches": comparison.num_batches,
            "output_sqnr_db": number(comparison.output_sqnr_db, 2),
            "output_cosine": number(comparison.output_cosine, 6),
            "compared_against": compared_against,
            "worst_layers": [layer.to_dict() for layer in comparison.worst(len(comparison.layers))
                             if layers is None or layer.name in layers][:WORST_LAYERS]}


def accuracy_line(doc: dict[str, Any]) -> str:
    return (f"accuracy vs float on {doc['evaluated_on']} ({doc['batches']} batch(es)): output SQNR "
            f"{doc['output_sqnr_db']} dB, cosine {doc['output_cosine']}")


def worst_layers_table(doc: dict[str, Any]) -> Any:
    """The layers with the lowest SQNR, worst first."""
    table = new_table("layer", "float", "int8", "SQNR dB", right=("SQNR dB",),
                      title=f"worst {len(doc['worst_layers'])} layers by SQNR "
                            f"(against the {doc['compared_against']})")
    for layer in doc["worst_layers"]:
        table.add_row(layer["name"], layer["float_type"], layer["quant_type"],
                      f"{float(layer['sqnr_db']):.1f}")
    return table

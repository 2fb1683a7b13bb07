"""GPTQ/AWQ's recorded calibration inputs: one copy per input tensor, the rows one copy per layer kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qplug_core.weight_only.awq import record_inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("max_rows", [10, 100])  # rows taken across batches; every row
def test_linears_reading_one_tensor_share_one_copy_of_the_rows_each_would_keep(max_rows):
    """q/k/v (and gate/up) were kept as three (two) copies: 2.8x the linears' bytes on a decoder."""
    model = _llama()
    layers = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"}
    g = torch.Generator().manual_seed(0)
    calibration = [torch.randint(0, 256, (1, 8), generator=g) for _ in range(3)]
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in layers}
    handles = [m.register_forward_pre_hook(lambda m, args, name=name: seen[name].append(
        args[0].reshape(-1, args[0].shape[-1]).clone())) for name, m in layers.items()]
    with torch.no_grad():
        for batch in calibration:
            model(batch)
    for handle in handles:
        handle.remove()

    kept = record_inputs(model, layers, calibration, max_rows)

    for name, chunks in seen.items():  # the rows a copy per layer kept: evenly spaced over all
        rows = torch.cat(chunks)
        expected = rows[torch.linspace(0, rows.shape[0] - 1, max_rows).long()] if rows.shape[0] > max_rows else rows
        assert torch.equal(kept[name], expected), name
    storages = {tensor.untyped_storage().data_ptr() for tensor in kept.values()}
    assert len(kept) == 7 and len(storages) == 4  # q/k/v, o, gate/up, down
    attention = "model.layers.0.self_attn."
    assert kept[attention + "q_proj"] is kept[attention + "k_proj"] is kept[attention + "v_proj"]

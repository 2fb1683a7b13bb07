"""Quantize a Hugging Face transformers model: capture="auto" falls back to torch.export."""

import torch
from transformers import BertConfig, BertModel

import qplug_core as qp


class LastHiddenState(torch.nn.Module):
    """Call the model with keyword inputs, as users do, and return its main output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


torch.manual_seed(0)
config = BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=512, max_position_embeddings=64)
model = LastHiddenState(BertModel(config, add_pooling_layer=False)).eval()


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (2, 16), generator=gen), torch.ones(2, 16, dtype=torch.long)


int8 = qp.quantize(model, batch(0), [batch(s) for s in range(1, 5)], backend="fbgemm")
report = qp.quantization_report(int8)
print(report.capture)  # "export": BERT does not trace symbolically
print(report.kernels["model.encoder.layer.0.attention.self.query"])  # quantized::linear
int8.get_submodule("model.encoder.layer.0.attention.self.query")  # the user's module names

# an ExportedProgram (or its .module()) is accepted as is
program = torch.export.export(model, batch(0), strict=False)
same = qp.quantize(program, batch(0), [batch(s) for s in range(1, 5)], backend="fbgemm")
x = batch(9)
# the same int8 model but for the position and token-type embeddings: exported at fixed sizes,
# their lookups read constant indices and fold to float constants
print(sorted(set(report.kernels) - set(qp.quantization_report(same).kernels)))
print(qp.sqnr(int8(*x), same(*x)) > 40)  # True

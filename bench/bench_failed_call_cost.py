"""What the explanation of failed calls (``qplug_core/ir/failed_calls.py``) costs a call that succeeds.

Run: ``python bench/bench_failed_call_cost.py [--rounds 20000] [--threads 1]``

Every converted graph model runs its calls through a function of its class whose ``try`` names the
input at fault when the call fails. Per model (the digits CNN at batch 1, a 2-layer MLP 32-64-10 at
batch 1, the zoo's BERT encoder at batch 1 x 16 tokens; fbgemm), a deep copy whose class calls
``nn.Module.__call__`` directly (torch.fx's own path) and the model as converted are called
round-robin, one call per sample; the table gives the median us per call and the ratio
explained / plain (1.00: no cost that the machine's noise shows).
"""

from __future__ import annotations

import argparse
import copy

import torch
from _harness import interleaved, machine_line, median, quiet, table
from torch import nn

import qplug_core as qp
from qplug_core.zoo import example_inputs, get_model


def _models() -> dict[str, tuple[nn.Module, tuple]]:
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).eval()
    return {"digits_cnn b1": (get_model("digits_cnn", seed=0), example_inputs("digits_cnn", 1, seed=0)),
            "mlp b1": (mlp, (torch.randn(1, 32),)),
            "bert_encoder b1x16": (get_model("bert_encoder", seed=0), example_inputs("bert_encoder", 1, seed=0))}


def _plain(qmodel: nn.Module) -> nn.Module:
    """A copy called as torch.fx calls a GraphModule without the explanation."""
    plain = copy.deepcopy(qmodel)
    type(plain)._wrapped_call.cls_call = None
    return plain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine_line())
    rows = []
    for name, (model, example) in _models().items():
        with quiet():
            explained = qp.quantize(model.eval(), example, [example] * 4, backend="fbgemm")
        plain = _plain(explained)
        with torch.inference_mode():
            assert torch.equal(explained(*example), plain(*example))
            times = interleaved({"plain": lambda: plain(*example), "explained": lambda: explained(*example)},
                                args.rounds, warmup=200)
        us = {variant: median(samples) * 1e6 for variant, samples in times.items()}
        rows.append([name, f"{us['plain']:.2f}", f"{us['explained']:.2f}", f"{us['explained'] / us['plain']:.3f}"])
    print(table(["model", "plain us", "explained us", "ratio"], rows))


if __name__ == "__main__":
    main()

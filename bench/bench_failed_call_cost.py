"""What the explanation of failed calls (``qplug_core/ir/failed_calls.py``, and for module-swap
models ``qplug_core/kernels/layer_faults.py``) costs a call that succeeds.

Run: ``python bench/bench_failed_call_cost.py [--rounds 20000] [--threads 1] [--clock process]``

Every converted graph model runs its calls through a function of its class whose ``try`` names the
input at fault when the call fails. Per model (the digits CNN at batch 1, a 2-layer MLP 32-64-10 at
batch 1, the zoo's BERT encoder at batch 1 x 16 tokens; fbgemm), a deep copy whose class calls
``nn.Module.__call__`` directly (torch.fx's own path) and the model as converted are called
round-robin, one call per sample; the table gives the median us per call and the ratio
explained / plain (1.00: no cost that the machine's noise shows).

Module-swap models (``qp.quantize_dynamic`` on fbgemm: a 1-layer LSTM 32-64 at batch 1 x 8 steps, a
MiniLM-sized BERT (6 layers, 384 wide, 12 heads, from its config) at batch 1 x 16 tokens, per-tensor
and per-token) get the same treatment: the plain copy's swapped layers call ``nn.Module.__call__``
directly. ``--clock process`` counts this process's CPU time (the shared box's other processes
then do not show).
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Callable

import torch
from _harness import interleaved, machine_line, median, quiet, table
from torch import nn

import qplug_core as qp
from qplug_core.kernels.layer_faults import ExplainedLayer
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


def _swap_models() -> dict[str, tuple[Callable[[], nn.Module], tuple]]:
    """Module-swap models: (how to quantize it, its example)."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    lstm = nn.Sequential(nn.LSTM(32, 64)).eval()
    bert = BertModel(BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                intermediate_size=1536), add_pooling_layer=False).eval()
    ids = (torch.randint(0, 30522, (1, 16)),)
    return {"dynamic lstm b1x8": (lambda: qp.quantize_dynamic(lstm, backend="fbgemm"), (torch.randn(8, 1, 32),)),
            "dynamic minilm-sized b1x16": (lambda: qp.quantize_dynamic(bert, backend="fbgemm"), ids),
            "per-token minilm-sized b1x16": (lambda: qp.quantize_dynamic(bert, backend="fbgemm", per_token=True),
                                             ids)}


def _swapped_plain(qmodel: nn.Module) -> nn.Module:
    """A copy whose swapped layers call ``nn.Module.__call__`` directly (no explanation)."""
    plain = copy.deepcopy(qmodel)
    for module in plain.modules():
        if isinstance(module, ExplainedLayer):
            module.__class__ = type(type(module).__name__, (type(module),), {"__call__": nn.Module.__call__})
    return plain


def _row(name: str, explained: nn.Module, plain: nn.Module, example: tuple, rounds: int,
         clock: Callable[[], float]) -> list[str]:
    with torch.inference_mode():
        first, second = explained(*example), plain(*example)
        first, second = (first[0], second[0]) if isinstance(first, tuple) else (first, second)
        if hasattr(first, "last_hidden_state"):
            first, second = first.last_hidden_state, second.last_hidden_state
        assert torch.equal(first, second)
        times = interleaved({"plain": lambda: plain(*example), "explained": lambda: explained(*example)},
                            rounds, warmup=200, clock=clock)
    us = {variant: median(samples) * 1e6 for variant, samples in times.items()}
    return [name, f"{us['plain']:.2f}", f"{us['explained']:.2f}", f"{us['explained'] / us['plain']:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--only", choices=("graph", "swap"), default=None, help="one kind of model only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "process" else time.perf_counter
    print(machine_line())
    rows = []
    if args.only != "swap":
        for name, (model, example) in _models().items():
            with quiet():
                explained = qp.quantize(model.eval(), example, [example] * 4, backend="fbgemm")
            rows.append(_row(name, explained, _plain(explained), example, args.rounds, clock))
    if args.only != "graph":
        for name, (quantize, example) in _swap_models().items():
            with quiet():
                explained = quantize()
            rows.append(_row(name, explained, _swapped_plain(explained), example, args.rounds, clock))
    print(table(["model", "plain us", "explained us", "ratio"], rows))


if __name__ == "__main__":
    main()

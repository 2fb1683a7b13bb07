"""What checking a delegated partition's embedding ids costs a call (``partition/id_bounds.py``).

Run: ``python bench/bench_id_check_cost.py [--backends onnxruntime openvino] [--rounds 3000]``

The zoo's BERT encoder quantized on a delegate has one partition whose tables get the caller's
``input_ids`` and the positions it computes from their length (``arange``). Per backend and input
shape (batch x tokens), the model as converted and a deep copy whose partition checks no ids are
called round-robin, one call per sample, timed by the process's CPU clock (the shared box's load
does not count); the table gives the median us per call, the difference (what the check costs)
and the ratio checked / unchecked. Run it in an older checkout (copy this file into its
``bench/``: ``_harness`` imports the ``qplug_core`` beside it) for the figures before a change.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _harness import interleaved, machine_line, median, quiet, table

import qplug_core as qp
from qplug_core.partition.served import runs
from qplug_core.zoo import example_inputs, get_model


def _unchecked(qmodel: torch.nn.Module) -> torch.nn.Module:
    """A copy whose compiled partitions check no ids."""
    plain = copy.deepcopy(qmodel)
    for module in plain.children():
        compiled = runs(module)
        if "_id_bounds" in vars(compiled):
            vars(compiled)["_id_bounds"] = None
    return plain


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["onnxruntime"])
    parser.add_argument("--shapes", nargs="+", default=["1x16", "8x64"], help="batch x tokens")
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    rows = []
    for backend in args.backends:
        example = example_inputs("bert_encoder", 1, seed=0)
        with quiet():
            checked = qp.quantize(get_model("bert_encoder", seed=0), example, [example] * 2, backend=backend)
        unchecked = _unchecked(checked)
        for shape in args.shapes:
            batch, tokens = (int(n) for n in shape.split("x"))
            ids = torch.randint(0, 1000, (batch, tokens), generator=torch.Generator().manual_seed(0))
            x = (ids, torch.ones(batch, tokens, dtype=torch.long))[:len(example)]
            with torch.inference_mode(), quiet():
                assert torch.equal(checked(*x), unchecked(*x))
                times = interleaved({"unchecked": lambda: unchecked(*x), "checked": lambda: checked(*x)},
                                    args.rounds, warmup=50, clock=time.process_time)
            us = {variant: median(samples) * 1e6 for variant, samples in times.items()}
            rows.append([backend, shape, f"{us['unchecked']:.1f}", f"{us['checked']:.1f}",
                         f"{us['checked'] - us['unchecked']:.1f}", f"{us['checked'] / us['unchecked']:.3f}"])
    print(table(["backend", "batch x tokens", "unchecked us", "checked us", "check us", "ratio"], rows))


if __name__ == "__main__":
    main()

"""Where the time goes: ORT's profiler on qplug's static MiniLM session and on ORT's own model.

Issue 25 asks the static all-MiniLM-L6-v2 (real weights, 8x128 tokens, 1 thread) on onnxruntime
to be no slower than ORT's own ``quantize_dynamic`` model. This runs both sessions (qplug's as
built, with its ``SessionSettings``; ORT's own with default options) under ``enable_profiling``
and prints, per ORT op type and for the slowest nodes, the kernel time per run, so a gap can be
traced to an op (float matmuls the accuracy target kept float, QuantizeLinear pairs, fusions).
``--model`` takes a file from ``qp.save`` of the static model (quantizing takes minutes).

    python bench/profile_ort_minilm.py [--model minilm_static.qplug] [--runs 10]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch
from _harness import machine_line, quiet, table
from bench_onnxruntime_dynamic import ort_quantize_dynamic_model

import qplug_core as qp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _profile(model: bytes | str, feeds, runs: int, prefix: str, disabled: tuple[str, ...] = ()):
    """(kernel microseconds per op type, per node) per run of one session."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    options.enable_profiling, options.profile_file_prefix = True, prefix
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=list(disabled))
    feed = feeds([i.name for i in session.get_inputs()])
    session.run(None, feed)  # warm-up, profiled too: subtracted below by taking later runs only
    for _ in range(runs):
        session.run(None, feed)
    events = [e for e in json.loads(Path(session.end_profiling()).read_text())
              if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    per_run = len(events) // (runs + 1)
    by_op, by_node = collections.Counter(), collections.Counter()
    for event in events[per_run:]:
        by_op[event["args"]["op_name"]] += event["dur"] / runs
        by_node[(event["args"]["op_name"], event["name"][:-len("_kernel_time")])] += event["dur"] / runs
    return by_op, by_node


def _qplug_sessions(static, batch):
    """(serialized model, inputs) of every ORT partition of ``static`` as called on ``batch``."""
    from qplug_onnxruntime.session import OrtPartition

    seen = []
    original = OrtPartition.run

    def record(self, compiled, inputs):
        seen.append((self.sources[self.compiled.index(compiled)], inputs, self.session_settings))
        return original(self, compiled, inputs)

    OrtPartition.run = record
    try:
        with torch.no_grad():
            static(*batch)
    finally:
        OrtPartition.run = original
    return seen


def main() -> None:
    from tests.support.sentence_embeddings import load_minilm, read_sentences, split_sentences, token_batches

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, help="qp.save of the static model (default: quantize it)")
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    minilm = load_minilm()
    calibration, evaluation = split_sentences(read_sentences(ROOT / "tests" / "data" / "sentences_en.txt"))
    encoded = minilm.tokenizer(evaluation[:8], padding="max_length", max_length=128, return_tensors="pt")
    batch = (encoded["input_ids"], encoded["attention_mask"])
    with quiet():
        if args.model is not None:
            static = qp.load(args.model)
        else:
            cal = token_batches(minilm.tokenizer, calibration)
            static = qp.quantize(minilm.model, cal[0], cal, backend="onnxruntime")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        profiles = {}
        for i, (source, inputs, settings) in enumerate(_qplug_sessions(static, batch)):
            profiles[f"qplug static, partition {i}"] = _profile(
                source, lambda names, inputs=inputs: {n: t.numpy() for n, t in zip(names, inputs)}, args.runs,
                f"{tmp}/qplug{i}", settings.disabled_optimizers)
        own = ort_quantize_dynamic_model(minilm.model, batch, ["input_ids", "attention_mask"], Path(tmp))
        profiles["ORT quantize_dynamic"] = _profile(
            str(own), lambda names: {"input_ids": batch[0].numpy(), "attention_mask": batch[1].numpy()},
            args.runs, f"{tmp}/own")
    for name, (by_op, by_node) in profiles.items():
        total = sum(by_op.values())
        rows.append([name, "total", f"{total / 1e3:.2f}", "100%"])
        rows += [[name, op, f"{us / 1e3:.2f}", f"{us / total:.0%}"] for op, us in by_op.most_common(12)]
        rows += [[name, f"  {op} {node}", f"{us / 1e3:.2f}", f"{us / total:.0%}"]
                 for (op, node), us in by_node.most_common(6)]
    print(machine_line())
    print(table(["session", "op (type, or slowest node)", "ms per run", "share"], rows))


if __name__ == "__main__":
    main()

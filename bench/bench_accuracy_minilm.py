"""Trained-transformer accuracy and latency: real all-MiniLM-L6-v2 weights, int8 vs float (issue 18).

Run: ``python bench/bench_accuracy_minilm.py [--sentences tests/data/sentences_en.txt]
[--threads 1] [--rounds 5] [--variants static,static-none,static-zoo,dynamic,per-token]
[--swap-halves] [--backend fbgemm]`` (``--variants`` builds and times only those, against the float
model; default: all; ``--backend`` is the static variants' backend, e.g. ``onnxruntime``).

Sentences (one per line) are split even/odd into calibration and evaluation halves
(``--swap-halves``: odd ones calibrate, even ones evaluate). The float
reference is the Hugging Face ``BertModel`` in eager mode; the embedding is sentence-transformers'
(mean pooling over the attention mask, L2 normalisation). Variants:

* ``static int8``: ``qp.quantize`` on the Hugging Face model itself with the transformer defaults
  (captured with torch.export; ``recipe="auto"``: SmoothQuant, then ``Target(cosine=0.998,
  min_cosine=0.995)`` on the calibration half, scored on the pooled embedding), fbgemm kernels
  (or ``--backend``'s);
* ``static int8, recipe="none"``: the same without any algorithm, for comparison;
* ``static int8, zoo clone``: the defaults on the zoo's symbolically traceable BERT encoder holding
  the same weights (checked equal to 1e-6 below), whose output is the pooled embedding;
* ``dynamic int8``: ``qp.quantize_dynamic`` on the HF model (per-tensor activations, fbgemm);
* ``per-token dynamic``: ``qp.quantize_dynamic(per_token=True)`` on the HF model.

Accuracy is measured on the evaluation half (never seen by calibration or the target search):
cosine to the float embedding (mean, min) and the fraction of sentences whose nearest other
sentence is unchanged. Latency: 8 sentences padded to 128 tokens, all variants timed round-robin
in one run; the ratio is float latency / variant latency.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

import torch
from _harness import interleaved, machine_line, median, p90, quiet, table

import qplug_core as qp
from tests.support.sentence_embeddings import (
    agreement,
    as_zoo_encoder,
    embed,
    load_minilm,
    read_sentences,
    split_sentences,
    token_batches,
)

ROOT = Path(__file__).resolve().parent.parent
VARIANT_KEYS = ("static", "static-none", "static-zoo", "dynamic", "per-token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sentences", type=Path, default=ROOT / "tests" / "data" / "sentences_en.txt")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--swap-halves", action="store_true",
                        help="calibrate on the odd sentences, evaluate on the even ones")
    parser.add_argument("--build-rounds", type=int, default=1,
                        help="build every variant this many times, alternated in one process; "
                             "the build column is the median (the machine is noisy)")
    parser.add_argument("--backend", default="fbgemm", help="the static variants' backend")
    parser.add_argument("--variants", default=",".join(VARIANT_KEYS),
                        help=f"comma-separated, from: {', '.join(VARIANT_KEYS)}")
    args = parser.parse_args()
    chosen = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = sorted(set(chosen) - set(VARIANT_KEYS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANT_KEYS)}")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    minilm = load_minilm()
    calibration, evaluation = split_sentences(read_sentences(args.sentences))
    if args.swap_halves:
        calibration, evaluation = evaluation, calibration
    cal = token_batches(minilm.tokenizer, calibration)
    ev = token_batches(minilm.tokenizer, evaluation)
    reference = embed(minilm.model, ev)
    zoo = as_zoo_encoder(minilm.model)
    print(machine_line())
    print(f"{len(calibration)} calibration / {len(evaluation)} evaluation sentences from "
          f"{args.sentences.name}{' (halves swapped)' if args.swap_halves else ''}; zoo clone vs HF max |diff| "
          f"{float((embed(zoo, ev) - reference).abs().max()):.1e}")

    builders = {
        "static": ("static int8", lambda: qp.quantize(minilm.model, cal[0], cal, backend=args.backend)),
        "static-none": ('static int8, recipe="none"',
                        lambda: qp.quantize(minilm.model, cal[0], cal, backend=args.backend, recipe="none")),
        "static-zoo": ("static int8, zoo clone", lambda: qp.quantize(zoo, cal[0], cal, backend=args.backend)),
        "dynamic": ("dynamic int8", lambda: qp.quantize_dynamic(minilm.model, backend="fbgemm")),
        "per-token": ("per-token dynamic",
                      lambda: qp.quantize_dynamic(minilm.model, backend="fbgemm", per_token=True)),
    }
    variants, build_seconds = {}, collections.defaultdict(list)
    with quiet():  # untimed: torch.export's one-time warm-up must not be billed to the first build
        qp.quantize(minilm.model, cal[0], cal[:1], backend=args.backend, recipe="none")
        for _ in range(args.build_rounds):
            for key in chosen:
                name, build = builders[key]
                start = time.perf_counter()
                variants[name] = build()
                build_seconds[name].append(time.perf_counter() - start)

    for name in ("static int8", "static int8, zoo clone"):
        target = variants[name].meta.get("qplug_target") if name in variants else None
        if target is not None:
            taken = ", ".join(f"{d.name} ({d.fallback})" for d in target.decisions) or "none"
            kept = target.final.neighbours_kept
            print(f"{name}: target met={target.met} after {target.quantizations} quantizations "
                  f"(one calibration); on the calibration half cosine {target.final.cosine_mean:.4f} / "
                  f"{target.final.cosine_min:.4f}"
                  + (f", neighbours kept {100 * kept:.0f}%" if kept is not None else "")
                  + f"; out of static int8: {taken}")

    enc = minilm.tokenizer(evaluation[:8], padding="max_length", max_length=128, return_tensors="pt")
    batch = (enc["input_ids"], enc["attention_mask"])
    zoo_timed = {"fp32 zoo clone": zoo} if any(k.startswith("static") for k in chosen) else {}
    timed = {"fp32 eager (HF)": minilm.model, **zoo_timed, **variants}
    with torch.no_grad(), quiet():
        samples = interleaved({n: (lambda m=m: m(*batch)) for n, m in timed.items()},
                              rounds=args.rounds)
    base = median(samples["fp32 eager (HF)"])
    none = build_seconds.get('static int8, recipe="none"')
    plain = median(none) if none else None
    rows = []
    for name, model in timed.items():
        with quiet():
            a = agreement(reference, embed(model, ev))
        rows.append([name, f"{a.cosine_mean:.4f}", f"{a.cosine_min:.4f}",
                     f"{100 * a.neighbours_kept:.0f}%", f"{median(samples[name]) * 1e3:.0f}",
                     f"{p90(samples[name]) * 1e3:.0f}", f"{base / median(samples[name]):.2f}x",
                     f"{median(build_seconds[name]):.1f}" if name in build_seconds else "0",
                     f"{median(build_seconds[name]) / plain:.2f}x" if name in build_seconds and plain else ""])
    print(table(["variant", "cos mean", "cos min", "NN kept", "ms med", "ms p90", "vs fp32",
                 "build s", "build / none"], rows))
    print(f"latency: 8 x 128 tokens, {args.threads} thread(s), {args.rounds} interleaved rounds; "
          f"build: median of {args.build_rounds} alternated round(s)")


if __name__ == "__main__":
    sys.exit(main())

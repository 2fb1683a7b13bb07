"""GPTQ / AWQ calibration of a Qwen2-0.5B-shaped decoder (random weights from the config): peak RSS
and wall time of ``qp.quantize_weights(bits=4, group_size=128)`` on 8 sequences of 128 tokens, each
run in a fresh subprocess, source trees interleaved (``--trees OLD NEW`` compares two checkouts);
on small config-built Llama and Qwen2 models, top-1 token agreement and logits cosine with fp32
on held-out sequences; and AWQ's scale search on all output rows against a subsample of them.

    python bench/bench_weight_only_calibration.py memory --layers 4 --trees /tmp/base .
    python bench/bench_weight_only_calibration.py recording --layers 2 --rounds 3 --trees /tmp/base .
    python bench/bench_weight_only_calibration.py accuracy --kernel reference --trees /tmp/base .
    python bench/bench_weight_only_calibration.py awq-search
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _harness import machine_line, table

PLUGINS = ("qplug_fbgemm", "qplug_qnnpack", "qplug_onnxruntime", "qplug_openvino")


def qwen2_05b(layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(config).eval()


def small(family: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True)).eval()


def tokens(count: int, length: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, length), generator=g) for _ in range(count)]


def run_memory(algorithm: str, layers: int) -> dict:
    """In this (fresh) process: build the model, quantize it, report peak RSS and wall time."""
    import resource
    import time
    import warnings

    import torch

    import qplug_core as qp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = qwen2_05b(layers)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    start = time.perf_counter()
    qp.quantize_weights(model, bits=4, group_size=128, algorithm=algorithm,
                        calibration_data=tokens(8, 128, model.config.vocab_size, 1))
    return {"seconds": time.perf_counter() - start, "built_gib": built,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_recording(how: str, layers: int) -> dict:
    """In this (fresh) process: record GPTQ's calibration inputs of every linear, the whole model at
    once or block by block (blocks not quantized: the recording alone), and the peak RSS."""
    import resource
    import time

    import torch

    from qplug_core.weight_only.awq import GPTQ_ROWS, record_inputs
    from qplug_core.weight_only.sequential import calibrate

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = qwen2_05b(layers)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    calibration = tokens(8, 128, model.config.vocab_size, 1)
    built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    largest = [0]

    def hold(inputs: dict) -> None:
        held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in inputs.values()}
        largest[0] = max(largest[0], sum(held.values()))

    start = time.perf_counter()
    with torch.no_grad():
        if how == "whole":
            hold(record_inputs(model, {n: model.get_submodule(n) for n in names}, calibration, GPTQ_ROWS))
        else:
            calibrate(model, names, calibration, GPTQ_ROWS, hold)
    return {"seconds": time.perf_counter() - start, "built_gib": built, "recorded_gib": largest[0] / 2**30,
            "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_accuracy(family: str, algorithm: str, seed: str = "0", kernel: str = "") -> dict:
    import warnings

    import torch

    import qplug_core as qp

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(int(seed))
    model = small(family)
    vocab = model.config.vocab_size
    qmodel = qp.quantize_weights(model, bits=4, group_size=32, algorithm=algorithm,
                                 calibration_data=tokens(8, 128, vocab, 1), kernel=kernel or None)
    agree, cosines = [], []
    with torch.no_grad():
        for ids in tokens(8, 64, vocab, 2):
            want, got = model(ids).logits, qmodel(ids).logits
            agree.append(float((want.argmax(-1) == got.argmax(-1)).float().mean()))
            cosines.append(float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), 0)))
    return {"agreement": sum(agree) / len(agree), "cosine": sum(cosines) / len(cosines),
            "calibration": getattr(qmodel.qplug_weight_only, "calibration", "")}


def awq_search(rounds: int) -> list[list[str]]:
    """AWQ's scale search on every linear group's recorded inputs, all output rows against
    ``SEARCH_ROWS`` of them, interleaved in this process: time, same scale picked, and the
    all-rows output error of the subsampled pick over the all-rows pick's."""
    import time
    import warnings

    import torch

    from qplug_core.kernels.weight_only_scheme import WeightOnlyScheme, quantize
    from qplug_core.weight_only.api import sibling_groups
    from qplug_core.weight_only.awq import MAX_ROWS, SEARCH_ROWS, awq_input_scale, record_inputs
    from tests.support.sentence_embeddings import load_minilm, read_sentences, split_sentences, token_batches

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    minilm = load_minilm()
    sentences = Path(__file__).resolve().parents[1] / "tests" / "data" / "sentences_en.txt"
    qwen2 = qwen2_05b(2)
    cases = [("all-MiniLM-L6-v2", minilm.model, token_batches(minilm.tokenizer, split_sentences(
        read_sentences(sentences))[0]), WeightOnlyScheme(4, 32, False)),
        ("Qwen2-0.5B shape, 2 layers", qwen2, tokens(8, 128, qwen2.config.vocab_size, 1), WeightOnlyScheme(4, 128))]
    rows = []
    for label, model, calibration, scheme in cases:
        linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
        inputs = record_inputs(model, linears, calibration, MAX_ROWS)
        groups, _ = sibling_groups(model, linears, calibration)
        grouped = {n for g in groups for n in g}
        groups += [(n,) for n in linears if n not in grouped]
        times = {None: 0.0, SEARCH_ROWS: 0.0}
        same, ratios = 0, []
        for names in groups:
            weights, x = [linears[n].weight.detach() for n in names], inputs[names[0]]
            picked = {}
            for _ in range(rounds):
                for search_rows in (None, SEARCH_ROWS):
                    start = time.perf_counter()
                    picked[search_rows] = awq_input_scale(weights, x, scheme, search_rows)
                    times[search_rows] += time.perf_counter() - start

            def error(scale: torch.Tensor) -> float:
                s = 1 / scale
                return sum(float((x @ (quantize(w * s, scheme).dequantize() / s - w).T).square().mean())
                           / float((x @ w.T).square().mean()) for w in weights)

            same += torch.equal(picked[None], picked[SEARCH_ROWS])
            ratios.append(error(picked[SEARCH_ROWS]) / error(picked[None]))
        rows.append([label, str(len(groups)), f"{times[None] / rounds:.2f}", f"{times[SEARCH_ROWS] / rounds:.2f}",
                     f"{times[None] / times[SEARCH_ROWS]:.2f}x", f"{same}/{len(groups)}",
                     f"{max(ratios):.4f}", f"{sum(ratios) / len(ratios):.4f}"])
    return rows


def in_subprocess(tree: str, *args: str) -> dict:
    root = Path(tree).resolve()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *(str(root / "plugins" / p) for p in PLUGINS)]))
    script = root / "bench" / Path(__file__).name  # that tree's copy: _harness puts its own tree first on sys.path
    command = ["taskset", "-c", os.environ.get("BENCH_CPU", "1"), sys.executable, str(script), "_child", *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["memory", "recording", "accuracy", "awq-search", "_child"])
    parser.add_argument("--trees", nargs="+", default=["."])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--algorithms", nargs="+", default=["gptq", "awq"])
    parser.add_argument("--seed", type=int, default=0, help="accuracy: the small models' weights")
    parser.add_argument("--kernel", default="", help="accuracy: force this kernel (\"reference\" compares the "
                        "calibration alone: kernels picked by timing round differently from run to run)")
    parser.add_argument("rest", nargs="*")
    options = parser.parse_args()
    if options.what == "_child":
        kind, *args = options.rest
        runs = {"memory": run_memory, "recording": run_recording, "accuracy": run_accuracy}
        result = runs[kind](args[0], int(args[1])) if kind != "accuracy" else run_accuracy(*args)
        print(json.dumps(result))
        return
    print(machine_line())
    if options.what == "awq-search":
        print(table(["AWQ scale search", "groups", "all rows s", "subsampled s", "speed-up", "same scale",
                     "error ratio max", "error ratio mean"], awq_search(options.rounds)))
        return
    rows = []
    if options.what == "recording":
        seconds: dict[str, list[float]] = {}
        for _ in range(options.rounds):
            for how, tree in [("whole", options.trees[0])] + [("blocks", tree) for tree in options.trees]:
                r = in_subprocess(tree, "recording", how, str(options.layers))  # interleaved
                seconds.setdefault(f"{how} {tree}", []).append(r["seconds"])
                rows.append([how, tree, f"{r['recorded_gib']:.3f}", f"{r['built_gib']:.2f}", f"{r['peak_gib']:.2f}",
                             f"{r['peak_gib'] - r['built_gib']:.2f}", f"{r['seconds']:.1f}"])
        print(table([f"GPTQ recording, Qwen2-0.5B shape, {options.layers} layers", "tree", "recorded GiB (most at once)",
                     "RSS built GiB", "peak RSS GiB", "peak - built", "s"], rows))
        whole = sorted(seconds.pop(f"whole {options.trees[0]}"))[options.rounds // 2]
        print("\n".join(f"{how}: median {sorted(s)[options.rounds // 2] / whole:.2f}x the whole-model recording's time"
                        for how, s in seconds.items()))
        return
    if options.what == "memory":
        for algorithm in options.algorithms:
            for _ in range(options.rounds):
                first = 0.0
                for tree in options.trees:  # interleaved
                    r = in_subprocess(tree, "memory", algorithm, str(options.layers))
                    first = first or r["seconds"]
                    rows.append([algorithm, tree, f"{r['built_gib']:.2f}", f"{r['peak_gib']:.2f}",
                                 f"{r['peak_gib'] - r['built_gib']:.2f}", f"{r['seconds']:.1f}",
                                 f"{first / r['seconds']:.2f}x"])
        print(table([f"Qwen2-0.5B shape, {options.layers} layers", "tree", "RSS built GiB", "peak RSS GiB",
                     "peak - built", "quantize s", "speed-up on the first tree (this round)"], rows))
        return
    for family in ("llama", "qwen2"):
        for algorithm in options.algorithms:
            for tree in options.trees:
                r = in_subprocess(tree, "accuracy", family, algorithm, str(options.seed), options.kernel)
                rows.append([family, algorithm, tree, f"{r['agreement']:.4f}", f"{r['cosine']:.5f}", r["calibration"]])
    print(table(["model", "algorithm", "tree", "top-1 agreement", "logits cosine", "calibration"], rows))


if __name__ == "__main__":
    main()

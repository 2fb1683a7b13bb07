"""Weight-only int8 / int4 and W8A8 on a Llama-architecture decoder: tokens/s of greedy ``generate()``.

A LlamaConfig model (~220 M parameters, random init), batch 1, a 32-token prompt, 64 new tokens
(greedy, no early stop), at 1 and 2 threads: fp32 eager against ``qp.quantize_weights`` int8 and
int4 (group 32, RTN; each layer runs the fastest correct kernel found on this CPU) and
``qp.quantize_w8a8`` (SmoothQuant on 4 random-token batches, per-token int8 activations). All variants
live in one process and are timed round-robin (``_harness.interleaved``). Also printed: weight
bytes (the model's tensors), the RSS each model added when built, the process's peak RSS,
logits cosine on the prompt and greedy-token agreement with fp32, and the kernel each layer
shape got with what every candidate measured.

The quantized models run their one-token decode steps on one thread where that measured faster
(``qplug_core.weight_only.decode_step``); ``--decode-step-ab`` also times each of them with that
choice switched off (``model.qplug_decode_threads.enabled = False``, "... per call" rows: the
thread count still chosen per int8 kernel call), in the same interleaved rounds, and prints what
each model chose.

    python bench/bench_llm.py [--rounds 2] [--layers 12] [--decode-step-ab]

On an AVX2 CPU without VNNI (Zen 3), emulated here: torch's own kernels, MKL (fp32 matmuls),
fbgemm and oneDNN (W8A8's int8 GEMM) forced to AVX2, and qplug's kernel choices made for an
AVX2-only flag set. ONNX Runtime's MLAS (``MatMulNBits``, the weight-only kernel) has no such
switch and still runs its AVX-512 VNNI code, so the weight-only figures of that run are not
AVX2's::

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        QPLUG_CPU_FLAGS="fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c" python bench/bench_llm.py
"""

from __future__ import annotations

import argparse
import collections
import resource
import warnings

import torch
from _harness import interleaved, machine_line, median, rss_bytes, table

import qplug_core as qp
from qplug_core.kernels import decode_threads


def tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def variants(models: dict, prompt: torch.Tensor, settings: dict, ab: bool) -> dict:
    """name -> a greedy ``generate()``; with ``ab``, each quantized model twice: with its decode-step
    thread choice and without (" per call")."""

    def generate(model, step_choice: bool):
        step = getattr(model, "qplug_decode_threads", None)
        if step is not None:
            step.enabled = step_choice
        return model.generate(prompt, **settings)

    out = {}
    for name, model in models.items():
        out[name] = lambda m=model: generate(m, True)
        if ab and hasattr(model, "qplug_decode_threads"):
            out[f"{name} per call"] = lambda m=model: generate(m, False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-step-ab", action="store_true",
                        help="also time each quantized model with its decode-step thread choice off (at 2 threads)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(2)
    print(machine_line())
    base = rss_bytes()
    fp32 = build(args.layers)
    models = {"fp32": fp32}
    added = {"fp32": rss_bytes() - base}
    params = sum(p.numel() for p in fp32.parameters())
    print(f"Llama: {params / 1e6:.0f} M parameters, {args.layers} layers, hidden 1024")
    for name, bits in (("int8 g32", 8), ("int4 g32", 4)):
        before = rss_bytes()
        models[name] = qp.quantize_weights(fp32, bits=bits, group_size=32)
        added[name] = rss_bytes() - before
    calibration = [torch.randint(0, 32000, (1, 64), generator=torch.Generator().manual_seed(10 + i))
                   for i in range(4)]
    before = rss_bytes()
    models["w8a8"] = qp.quantize_w8a8(fp32, calibration)
    added["w8a8"] = rss_bytes() - before
    prompt = torch.randint(0, 32000, (1, 32), generator=torch.Generator().manual_seed(1))
    settings = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                    eos_token_id=None, pad_token_id=0)

    with torch.no_grad():
        reference_logits = fp32(prompt).logits
        reference_tokens = fp32.generate(prompt, **settings)[0, 32:]
        rows = []
        for name, model in models.items():
            logits = model(prompt).logits
            tokens = model.generate(prompt, **settings)[0, 32:]
            cosine = torch.nn.functional.cosine_similarity(logits.flatten(), reference_logits.flatten(), dim=0)
            same = (tokens == reference_tokens).float().mean()
            first = int((tokens != reference_tokens).nonzero()[0]) if bool((tokens != reference_tokens).any()) \
                else len(tokens)
            rows.append([name, f"{tensor_bytes(model) / 2**20:.0f}", f"{added[name] / 2**20:.0f}",
                         f"{float(cosine):.5f}", f"{float(same):.3f}", str(first)])
        print(table(["model", "weights MiB", "RSS added MiB", "logits cos", "tokens equal", "first diff"], rows))
        for threads in (1, 2):
            torch.set_num_threads(threads)
            # at 1 thread the choice does nothing: no A/B
            samples = interleaved(variants(models, prompt, settings, args.decode_step_ab and threads > 1),
                                  args.rounds)
            fp32_time = median(samples["fp32"])
            print(f"\n{threads} thread(s), {args.new_tokens} new tokens after a 32-token prompt, "
                  f"median of {args.rounds} interleaved rounds; {machine_line()}")
            print(table(["model", "s / generate", "tokens/s", "x fp32"],
                        [[name, f"{median(s):.2f}", f"{args.new_tokens / median(s):.1f}",
                          f"{fp32_time / median(s):.2f}"] for name, s in samples.items()]))
    print(f"\npeak RSS of the process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB")
    for name, model in models.items():
        step = getattr(model, "qplug_decode_threads", None)
        if step is not None:
            print(f"{name} decode steps (threads, batch): {step.summary()}")
    budget = {f"{key[4]}x{key[5]} int{key[1]} ({key[0]})": "1 thread" if single else f"{threads} threads"
              for (key, threads), single in decode_threads.single_thread_choices().items()
              if isinstance(key, tuple) and len(key) == 7}  # weight-only: kernel, bits, group, symmetric, out, in, rows
    print(f"weight-only kernels inside one-thread decode steps (out x in): {budget}")
    w8a8 = models["w8a8"].qplug_w8a8
    print(f"\nw8a8: GEMM {w8a8.gemm}, {len(w8a8.layers)} int8 linears, {len(w8a8.smoothed)} inputs smoothed "
          f"(strengths {dict(collections.Counter(s.alpha for s in w8a8.smoothed))})")
    for name, model in models.items():
        info = getattr(model, "qplug_weight_only", None)
        if info is None:
            continue
        print(f"\n{name}: {len(info.fused)} groups of linears run as one call ({info.fusion}); "
              f"kernels {dict(collections.Counter(info.kernels.values()))}")
        for choice in info.choices:
            timings = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(choice.timings_ms.items(), key=lambda kv: kv[1]))
            rows = ", ".join(f"{r} rows {k:.3f} vs reference {ref:.3f} ms" for r, (k, ref) in choice.by_rows_ms.items())
            print(f"  -> {choice.kernel.name}: {timings}; float {choice.float_ms or float('nan'):.3f} ms; {rows}")


if __name__ == "__main__":
    main()

"""``qp.load`` of tampered files against their untouched twin: time and peak memory, as ratios.

Issue 27 asks that loading a tampered file never cost more than 2x its untouched twin. The twin
is a small conv net saved with ``qp.save`` (fbgemm); each tampered file edits only its JSON
header the way an attacker would (the edits of tests/reliability/test_file_objects.py,
test_terminal_injection.py and tests/unit/config/test_observer_bounds.py's file counterpart).
Every load runs in a fresh process (so peak RSS is that load's), variants rotate each round so
machine noise hits all alike, and the medians are reported as ratios to the twin: wall time of
the load, the process's peak RSS, and how much the peak grew during the load itself.

    python bench/bench_tampered_load.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "reliability"))  # the hostile-file edits the tests make
from artifactkit import rewrite_header, with_nodes  # noqa: E402


def child(path: str) -> None:
    import torch

    torch.set_num_threads(1)
    import qplug_core as qp

    qp.list_backends()  # plugins loaded before the clock starts, as in a server
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    try:
        qp.load(path)
        outcome = "loaded"
    except qp.errors.QplugError as error:
        outcome = type(error).__name__
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "peak_kb": peak, "grown_kb": peak - before,
                      "outcome": outcome}))


def _save(directory: Path) -> Path:
    import torch
    from torch import nn

    import qplug_core as qp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(16 * 16 * 16, 10)).eval()
    data = [torch.randn(4, 3, 16, 16) for _ in range(4)]
    return qp.save(qp.quantize(model, data[0], data, backend="fbgemm"), directory / "twin.safetensors")


def _placeholder(document) -> str:
    return next(n["name"] for n in document["model"]["graph"] if n["op"] == "placeholder")


def _placeholder_of(source: Path) -> str:
    raw = source.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    return _placeholder(json.loads(header["__metadata__"]["qplug"]))


#: name -> (source, target) -> tampered file
VARIANTS = {
    "torch.empty(2**28)": lambda s, t: with_nodes(s, t, {"op": "call_function", "name": "leak",
                                                         "target": "torch.empty", "args": [[2**28]]}),
    "x.new_empty(2**28)": lambda s, t: with_nodes(s, t, {
        "op": "call_method", "name": "leak", "target": "new_empty",
        "args": [{"node": _placeholder_of(s)}, [2**28]]}),
    "get_attr module hooks": lambda s, t: with_nodes(s, t, {"op": "get_attr", "name": "evil",
                                                            "target": "_forward_hooks"}),
    "method on x.dtype": lambda s, t: with_nodes(
        s, t, {"op": "call_function", "name": "r0", "target": "builtins.getattr",
               "args": [{"node": _placeholder_of(s)}, "dtype"]},
        {"op": "call_method", "name": "r1", "target": "to", "args": [{"node": "r0"}, "cpu"]}),
    "versions '[/red]'": lambda s, t: rewrite_header(s, t, lambda d: d["versions"].update(torch="[/red]")),
    "versions 10**5 entries": lambda s, t: rewrite_header(
        s, t, lambda d: d["versions"].update({f"d{i}": "1.0" for i in range(10**5)})),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    directory = Path(tempfile.mkdtemp())
    twin = _save(directory)
    files = {"untouched twin": twin}
    for i, (name, make) in enumerate(VARIANTS.items()):
        files[name] = make(twin, directory / f"tampered{i}.safetensors")
    results: dict[str, list[dict]] = {name: [] for name in files}
    names = list(files)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            out = subprocess.run([sys.executable, __file__, "--child", str(files[name])],
                                 capture_output=True, text=True, check=True, cwd=REPO)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = results["untouched twin"]
    base_s = statistics.median(r["seconds"] for r in base)
    base_kb = statistics.median(r["peak_kb"] for r in base)
    base_grown = statistics.median(r["grown_kb"] for r in base)
    print(f"{'file':28} {'outcome':22} {'load s':>8} {'x twin':>7} {'peak MB':>8} {'x twin':>7} "
          f"{'grown MB':>9} {'x twin':>7} {'size KB':>8}")
    for name, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = statistics.median(r["peak_kb"] for r in runs)
        grown = statistics.median(r["grown_kb"] for r in runs)
        size = files[name].stat().st_size / 1024
        print(f"{name:28} {runs[0]['outcome']:22} {seconds:8.3f} {seconds / base_s:7.2f} "
              f"{peak / 1024:8.1f} {peak / base_kb:7.2f} {grown / 1024:9.1f} "
              f"{grown / max(base_grown, 1):7.2f} {size:8.1f}")


if __name__ == "__main__":
    main()

"""Install the tiny backend (as `pip install -e docs_src/plugin_tiny` would), list it, use it."""

import importlib
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

import qplug_core as qp
from qplug_core import plugins

# 1. "Install" the plugin: a dist-info directory with the entry point, on sys.path.
#    This is what pip writes into site-packages; importlib.metadata finds it the same way.
site = Path(tempfile.mkdtemp())
info = site / "qplug_tiny-0.1.0.dist-info"
info.mkdir()
(info / "METADATA").write_text("Metadata-Version: 2.1\nName: qplug-tiny\nVersion: 0.1.0\n"
                               "Requires-Dist: qplug-core<0.2,>=0.1\n")
(info / "entry_points.txt").write_text("[qplug]\ntiny = qplug_tiny.plugin\n")
sys.path[:0] = [str(site), str(Path(__file__).parent / "plugin_tiny")]
importlib.invalidate_caches()
plugins.reset()  # forget plugins loaded so far; the next call discovers again

# 2. List it, as `qplug list-backends` does.
tiny = next(info for info in qp.list_backends() if info.name == "tiny")
print(tiny.name, tiny.status, [p["dist"] for p in tiny.to_dict()["plugins"]],
      tiny.n_pattern_configs, "pattern config,", tiny.n_kernels, "kernels")
assert tiny.status == "ok" and tiny.n_pattern_configs == 1

# 3. Quantize a model with it.
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
example = (torch.randn(2, 16),)
calibration = [torch.randn(8, 16) for _ in range(4)]
qmodel = qp.quantize(model, example, calibration, backend="tiny")

report = qp.quantization_report(qmodel)
print(report.kernels)   # {'0': 'quantized::linear', '2': 'quantized::linear'}
print(report.skipped)   # the ReLU has no pattern in this backend: it runs in float
assert set(report.kernels.values()) == {"quantized::linear"}
print(f"output SQNR {qp.compare(model, qmodel, calibration).output_sqnr_db:.1f} dB")

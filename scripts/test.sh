#!/usr/bin/env bash
# Run the test suite in the checkout's venv. Installs first (through
# scripts/install_cpu.sh) when the venv is missing or was installed from a
# different pyproject.toml / install script.
# Usage: scripts/test.sh [pytest args...]   (default: -q tests)
#   VENV=DIR   the venv (default: .venv in the checkout)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
export VENV
cd "$ROOT"

# What the installed venv depends on; install_cpu.sh stores this hash.
install_stamp() {
  cat pyproject.toml scripts/install_cpu.sh vllm_av/vllm/cpu_dist_alias.py | sha256sum | cut -d' ' -f1
}
if [[ "${1:-}" == "--print-install-stamp" ]]; then
  install_stamp
  exit 0
fi

STAMP="$VENV/.vllm_av_install_stamp"
if [[ ! -x "$VENV/bin/python" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$(install_stamp)" ]]; then
  echo "[test] installing into $VENV first (scripts/install_cpu.sh)"
  scripts/install_cpu.sh
fi

if [[ $# -eq 0 ]]; then
  set -- -q tests
fi
exec "$VENV/bin/python" -m pytest "$@"

# Shared set-up for scripts/*.sh: a .venv with torch (the CPU build on machines
# without a GPU), the project, and DeepSpeed's one JIT-built C++ op, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
install_project() {  # $1: extras spec, e.g. "[test]" or ""
  local stamp=".venv/.installed$1"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
      if has_gpu; then "$VPY" -m pip install -q torch; else "$VPY" -m pip install -q "torch==2.13.0"; fi
    fi
    "$VPY" -m pip install -q -e ".$1"
    touch "$stamp"
  fi
  if ! has_gpu; then export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"; fi
  # DeepSpeed JIT-builds its shared-memory op on first init_distributed (~40 s): do it once here
  "$VPY" -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" \
    >/dev/null 2>&1 || true
  # and ours (~20 s once), so the ranks of a job never race to build it
  "$VPY" -m moe_trainer.kernels.cpu.extension >/dev/null 2>&1 || true
}

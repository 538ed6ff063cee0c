# Shared set-up for scripts/*.sh: a .venv with torch (the CPU build on machines
# without a GPU), the project, and DeepSpeed's one JIT-built C++ op, once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "making .venv with $PY"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
install_project() {  # $1: extras spec, e.g. "[test]" or ""
  local stamp=".venv/.installed$1"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "installing the project into .venv (a few minutes the first time)"
    if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
      if has_gpu; then "$VPY" -m pip install -q torch; else "$VPY" -m pip install -q "torch==2.13.0"; fi
    fi
    "$VPY" -m pip install -q -e ".$1"
    touch "$stamp"
  fi
  if ! has_gpu; then export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"; fi
  # DeepSpeed's JIT-built ops live in this environment, not in the one per-user cache that every
  # environment on the machine would rebuild in turn (moe_trainer.train sets the same default)
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.venv/torch_extensions}"
  # the environment's ninja (DeepSpeed's dependency) before a system one: two ninja versions hash a
  # build's commands differently and rebuild each other's ops (train.use_this_environments_ninja)
  export PATH="$ROOT/.venv/bin:$PATH"
  # our fused CPU kernels (~20 s) and DeepSpeed's shared-memory op (~40 s, JIT-built by its first
  # init_distributed) are built here once, so the ranks of a job never race to build them; each is
  # announced only when it is not built yet (a failed build: the trainer warns and runs without it)
  "$VPY" -c "from moe_trainer.train import build_ops; build_ops()" 2>/dev/null | grep --line-buffered '^building' || true
}

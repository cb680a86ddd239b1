# shellcheck shell=bash disable=SC2034  # sets variables for the batch scripts that source it
# Sourced by the batch scripts in slurm/ (not run on its own). Slurm runs a copy of the batch
# script from its spool directory, so the repository is found from the submit directory
# (run sbatch from the repository root) or from DSPARK_REPO.
#
# Environment (all optional; sbatch passes the submitting shell's environment to the job):
#   EXPERIMENT         conf/experiment/NAME.yaml            (default: per script)
#   PYTHON             the project's interpreter            (default: .venv/bin/python)
#   DSPARK_OUTPUT_DIR  paths.output_dir; logs go to $DSPARK_OUTPUT_DIR/slurm (default: outputs)
#   DSPARK_ALLOW_CPU=1 run without GPUs (the CPU build of vLLM; tests and laptops)
#   DSPARK_REPO        the repository, when sbatch was not run from it

die() {
  echo "error: $*" >&2
  exit 2
}

# dspark_init STAGE: cd to the repository, set OUT, LOGDIR, RUNDIR, EXPERIMENT and PYTHON, check
# that the interpreter runs, and say what this job is.
dspark_init() {
  STAGE=$1
  OUT=${DSPARK_OUTPUT_DIR:-outputs}
  LOGDIR=$OUT/slurm
  JOB=${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:?not inside a Slurm job (SLURM_JOB_ID is unset); submit with sbatch}}
  RUNDIR=$LOGDIR/$JOB/$STAGE${SLURM_ARRAY_TASK_ID:+-task$SLURM_ARRAY_TASK_ID}
  mkdir -p "$RUNDIR" || die "cannot create the log directory $RUNDIR (DSPARK_OUTPUT_DIR=${DSPARK_OUTPUT_DIR:-unset})"
  PYTHON=${PYTHON:-.venv/bin/python}
  if ! command -v "$PYTHON" >/dev/null 2>&1 || [ ! -x "$(command -v "$PYTHON")" ]; then
    die "PYTHON=$PYTHON is not an executable in $PWD; expected the project's virtualenv interpreter" \
      "(.venv/bin/python, made by 'bash scripts/setup.sh gpu') or an absolute path to one"
  fi
  "$PYTHON" -c 'import hydra, omegaconf' 2>/dev/null \
    || die "PYTHON=$PYTHON cannot import hydra; expected the project's virtualenv (bash scripts/setup.sh gpu)"
  echo "dspark $STAGE: job $JOB${SLURM_ARRAY_TASK_ID:+ task $SLURM_ARRAY_TASK_ID}" \
    "restart ${SLURM_RESTART_COUNT:-0}, ${SLURM_NNODES:-1} node(s) ${SLURM_JOB_NODELIST:-?}," \
    "experiment $EXPERIMENT, python $PYTHON, logs $RUNDIR, $(date -Is)"
}

# dspark_gpus_per_node: GPUs Slurm gave this node (0 when none).
dspark_gpus_per_node() {
  if [ -n "${SLURM_GPUS_ON_NODE:-}" ]; then
    echo "$SLURM_GPUS_ON_NODE"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
  else
    echo 0
  fi
}

# dspark_require_gpus: fail unless this node has GPUs that nvidia-smi sees, or DSPARK_ALLOW_CPU=1.
dspark_require_gpus() {
  if [ "${DSPARK_ALLOW_CPU:-0}" = 1 ]; then
    echo "DSPARK_ALLOW_CPU=1: no GPU check; vLLM and DeepSpeed run on CPU"
    return 0
  fi
  local n
  n=$(dspark_gpus_per_node)
  [ "$n" -gt 0 ] || die "no GPUs allocated on $(hostname): expected --gpus-per-node=N (SLURM_GPUS_ON_NODE is" \
    "${SLURM_GPUS_ON_NODE:-unset}); submit with GPUs, or set DSPARK_ALLOW_CPU=1 for a CPU run"
  nvidia-smi -L >/dev/null 2>&1 \
    || die "Slurm allocated $n GPU(s) on $(hostname) but nvidia-smi cannot see them (driver missing?);" \
      "expected 'nvidia-smi -L' to list $n GPU(s)"
}

# dspark_compose: compose the config (experiment + OVERRIDES, the script's arguments) once on the
# batch host, so a misspelt experiment or override fails here in seconds, not on every node after
# srun; sets TP and PP from target.tensor_parallel_size / pipeline_parallel_size.
dspark_compose() {
  local target
  target=$("$PYTHON" train.py +experiment="$EXPERIMENT" "${OVERRIDES[@]}" --cfg job -p target 2>"$RUNDIR/compose.err") \
    || die "cannot compose +experiment=$EXPERIMENT ${OVERRIDES[*]}:" \
      "$(grep -v -e HYDRA_FULL_ERROR -e '^$' "$RUNDIR/compose.err" | head -n 8)"
  TP=$(sed -n 's/^tensor_parallel_size: *//p' <<<"$target")
  PP=$(sed -n 's/^pipeline_parallel_size: *//p' <<<"$target")
  if [ -z "$TP" ] || [ -z "$PP" ]; then
    die "the composed target has no tensor_parallel_size/pipeline_parallel_size: $target"
  fi
}

# dspark_check_parallel: one vLLM engine spread over the job's nodes needs exactly
# TP x PP GPUs; on one node, at most what the node was given. Needs dspark_compose first.
dspark_check_parallel() {
  local gpus nodes need
  gpus=$(dspark_gpus_per_node)
  nodes=${SLURM_NNODES:-1}
  need=$((TP * PP))
  echo "vLLM engine: TP$TP x PP$PP over $nodes node(s) x $gpus GPU(s)"
  [ "${DSPARK_ALLOW_CPU:-0}" = 1 ] && return 0
  if [ "$nodes" -gt 1 ] && [ "$need" -ne $((nodes * gpus)) ]; then
    die "target.tensor_parallel_size=$TP x pipeline_parallel_size=$PP needs $need GPUs, the job has" \
      "$nodes nodes x $gpus GPUs = $((nodes * gpus)); expected --nodes=$((need / (gpus > 0 ? gpus : 1)))" \
      "or target.tensor_parallel_size=$((nodes * gpus / PP))"
  fi
  if [ "$nodes" -eq 1 ] && [ "$need" -gt "$gpus" ]; then
    die "target.tensor_parallel_size=$TP x pipeline_parallel_size=$PP needs $need GPUs, this node has $gpus;" \
      "expected --gpus-per-node=$need, more nodes, or a smaller target.tensor_parallel_size"
  fi
}

# dspark_head_and_port: HEAD (first node of the job) and PORT (rendezvous, per job id).
dspark_head_and_port() {
  HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # not head: SIGPIPE under pipefail
  [ -n "$HEAD" ] || die "scontrol show hostnames '$SLURM_JOB_NODELIST' gave no host"
  PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
}

# dspark_requeue_on_usr1: #SBATCH --signal=B:USR1@SECONDS sends USR1 to this shell before the
# time limit; requeue the job (same id, so afterok dependents keep waiting) and let it resume.
dspark_requeue_on_usr1() {
  trap 'echo "time limit near: requeueing $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0})"; scontrol requeue "$SLURM_JOB_ID"; exit 0' USR1
}

# dspark_srun_node0 SRUN_OPTIONS... COMMAND...: srun COMMAND, one task per node; the job's result is node
# 0's (headless vLLM workers on other nodes are stopped by srun --wait once node 0 is done and do
# not decide success). Each node's exit status is kept in $RUNDIR/nodeN.rc.
dspark_srun_node0() {
  local rc=0
  rm -f "$RUNDIR"/node*.rc
  srun "$@" &
  wait $! || rc=$?
  if [ -f "$RUNDIR/node0.rc" ]; then
    rc=$(cat "$RUNDIR/node0.rc")
    echo "node exit codes: $(cd "$RUNDIR" && grep -H . node*.rc | tr '\n' ' ')"
  fi
  return "$rc"
}

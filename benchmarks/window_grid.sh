#!/usr/bin/env bash
# Issue #47 item 2: the window x training-length grid at the demo's budget (800 steps, seed 0), one
# W&B group; two multiruns because the grid is not a full product. Measured afterwards on the
# fixed_passage long-context set by benchmarks/window_sweep.py (one target pass for every drafter).
set -uo pipefail
cd "$(dirname "$0")/.."
export WANDB_MODE=offline
common=(+experiment=smollm2_cpu_demo 'stages=[train]' seed=0 logging.group=window-grid)
.venv/bin/python train.py -m "${common[@]}" train.max_seq_len=512 "train.run_name='wg512-\${drafter_tag:\${drafter}}'" \
  drafter.attention_window=null,256 hydra.sweep.dir=outputs/multirun/window-grid-512
.venv/bin/python train.py -m "${common[@]}" train.max_seq_len=1024 "train.run_name='wg1024-\${drafter_tag:\${drafter}}'" \
  drafter.attention_window=null,512 hydra.sweep.dir=outputs/multirun/window-grid-1024

#!/bin/bash
# What srun does for `srun --ntasks 2 python ddp_train.py`: one task per rank with SLURM_*
# variables set at start; RANK is left to the job.
pids=()
for i in 0 1; do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NTASKS=2 SLURM_JOB_ID=4242 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$1 "$PYTHON" "$(dirname "$0")/ddp_train.py" "${@:2}" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status

#!/usr/bin/env bash
# The ddp communication benchmark (bench/bench_ddp_comm.cpp): 2 ranks, 1 thread each, prints the share
# of step time spent waiting on the gradient all-reduce with and without overlap, and the load average
# the numbers were taken under (the machine may be shared).
#   bash bench/ddp_comm.sh [build dir] [extra bench_ddp_comm arguments...]
#   BOOSTER_BENCH_GROUP=tcp bash bench/ddp_comm.sh ...   # the same over the tcp group (no mpirun)
set -euo pipefail
build=${1:-build}
shift || true
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${BOOSTER_BENCH_GROUP:-mpi}" = tcp ]; then
  # torchrun's variables, no MPI: the default group is the tcp group.
  port=$((29000 + RANDOM % 1000))
  for r in 0 1; do
    WORLD_SIZE=2 RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      "$build/bin/bench_ddp_comm" "$@" &
  done
  wait
else
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
    mpirun -np 2 --oversubscribe "$build/bin/bench_ddp_comm" "$@"
fi
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

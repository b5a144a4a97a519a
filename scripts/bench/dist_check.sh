#!/usr/bin/env bash
# The distributed check on a CUDA machine, in one go (a few minutes): NCCL between the GPUs, then
# SmolLM2 served by `--tp-size 2` and `--pp-size 2` with one GPU per rank (greedy tokens against
# the single-process model, concurrency, prefix cache, a killed rank), then step times per
# configuration with bytes per rank. Paste the output (also $OUT/dist_check.log where $OUT is
# set) into docs/benchmarks.md. Prepare the machine as for gpu_check.sh (scripts/bench/gpu_prepare.py).
#
#   bash scripts/bench/dist_check.sh
#
# Two or more GPUs run the group on NCCL. With one GPU, NCCL cannot put two ranks on it: the
# script says so and checks the same group on the CPU (gloo) instead, plus NCCL's own init on the
# one GPU. DIST_CHECK_DEVICE=cpu rehearses the whole check on a CPU machine.
set -uo pipefail
source "$(dirname "$0")/check_env.sh"
DEVICE=${DIST_CHECK_DEVICE:-cuda}

check() {
  step "environment"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader || echo "nvidia-smi not found"
  nvidia-smi topo -m 2>/dev/null | head -8
  "$PY" -c "import torch, torch.distributed as d; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
  'gpus', torch.cuda.device_count(), 'nccl', d.is_nccl_available() and torch.cuda.nccl.version(), 'gloo', \
  d.is_gloo_available())" || { echo "torch does not import"; return 1; }
  GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
  if [ ! -f "$MLXCEL_MODELS_DIR/$MODEL/config.json" ] && [ -f .gpu/model/config.json ]; then
    MODEL=mlxcel-fixtures/smollm2-random-twin  # the real weights do not travel to the lent machine
    export MLXCEL_MODELS_DIR=/tmp/mlxcel-models
    timeout 120 "$PY" -m scripts.fixtures.build_random_twin .gpu/model "$MLXCEL_MODELS_DIR/$MODEL" \
      || { echo "could not build the random twin"; return 1; }
  fi
  [ -f "$MLXCEL_MODELS_DIR/$MODEL/config.json" ] || { echo "no $MODEL in $MLXCEL_MODELS_DIR"; return 1; }
  echo "model: $MODEL"

  if [ "$DEVICE" != cpu ]; then
    step "NCCL all-reduce, broadcast and send/recv over min(2, $GPUS) GPU rank(s)"
    timeout 120 "$PY" - "$GPUS" <<'PY'
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, world):
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29531", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    x = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    assert x[0].item() == world * (world + 1) / 2, x[0]
    y = torch.arange(8.0, device="cuda") if rank == 0 else torch.zeros(8, device="cuda")
    dist.broadcast(y, 0)
    assert y[7].item() == 7
    if world > 1:
        z = torch.ones(4, device="cuda") * 5
        dist.send(z, 1) if rank == 0 else dist.recv(z, 0)
        assert z.sum().item() == 20
    print(f"rank {rank}: NCCL all-reduce, broadcast, send/recv ok")
    dist.destroy_process_group()

world = max(1, min(2, int(sys.argv[1])))
mp.spawn(run, args=(world,), nprocs=world)
PY
    [ "$GPUS" -ge 2 ] || { echo "one GPU: a group needs one GPU per rank on NCCL; the group check runs on the CPU"; DEVICE=cpu; }
  fi

  step "SmolLM2 served by --tp-size 2 and --pp-size 2 on $DEVICE"
  MLXCEL_TEST_DEVICE=$DEVICE MLXCEL_TEST_MODEL=$MODEL timeout 600 "$PY" -m pytest -q -p no:cacheprovider -rs tests/e2e/test_distributed.py
  E2E=$?

  step "shards against the single process on zoo families (CPU, gloo; tp 2, pp 2, tp 2 x pp 2)"
  timeout 600 "$PY" -m pytest -q -p no:cacheprovider tests/backends/test_group_shards.py -k torch
  [ "$E2E" -ne 0 ] || E2E=$?

  step "step times per configuration, bytes per rank ($DEVICE)"
  for dtype in float32 bfloat16; do
    [ "$DEVICE" = cpu ] && [ "$dtype" = bfloat16 ] && continue
    timeout 600 "$PY" -m scripts.bench.dist_bench -m "$MLXCEL_MODELS_DIR/$MODEL" --device "$DEVICE" --dtype "$dtype" \
      --configs 1x1 2x1 1x2 $([ "${GPUS:-0}" -ge 4 ] && echo 2x2) --batch 1 8 32
  done

  step "done: tests exit $E2E"
  return $E2E
}

if [ -n "${OUT:-}" ]; then
  check 2>&1 | tee "$OUT/dist_check.log"
  exit "${PIPESTATUS[0]}"
fi
check

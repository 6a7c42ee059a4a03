#!/usr/bin/env bash
# Multi-node launch without SLURM: run this once on every node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 launch/torchrun.sh RECIPE.yaml [--key=value ...]
#
# torchrun starts one process per device and sets RANK / LOCAL_RANK / WORLD_SIZE, which Lightning
# reads as a torchelastic environment. Trailing arguments are recipe overrides for `lightning-rl run`.
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: NNODES=N NODE_RANK=R MASTER_ADDR=HOST GPUS_PER_NODE=G $0 RECIPE.yaml [--key=value ...]" >&2
    exit 2
fi
RECIPE=$1
shift

NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
# A node without nvidia-smi (CPU, ROCm, Neuron) counts no GPU; the pipeline must not end the script under pipefail.
GPUS_PER_NODE=${GPUS_PER_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}
if [[ "$GPUS_PER_NODE" -lt 1 ]]; then
    echo "error: no GPUs found; set GPUS_PER_NODE (processes per node)" >&2
    exit 2
fi
if [[ "$NODE_RANK" -ge "$NNODES" ]]; then
    echo "error: NODE_RANK=$NODE_RANK must be below NNODES=$NNODES" >&2
    exit 2
fi
if [[ "$NNODES" -gt 1 && -z "${MASTER_ADDR:-}" ]]; then
    echo "error: NNODES=$NNODES needs MASTER_ADDR, the first node's address (each node would wait on itself)" >&2
    exit 2
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}

# NCCL over InfiniBand; values already exported win.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}

LOG_DIR=${LOG_DIR:-logs/torchrun}
mkdir -p "$LOG_DIR"

# --redirects/--log-dir write one log per rank; --no-python runs the console script directly.
exec torchrun \
    --nnodes="$NNODES" --node-rank="$NODE_RANK" --nproc-per-node="$GPUS_PER_NODE" \
    --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
    --log-dir="$LOG_DIR" --redirects=3 --tee=3 \
    --no-python lightning-rl run "$RECIPE" \
    --trainer.num_nodes="$NNODES" --trainer.devices="$GPUS_PER_NODE" --ckpt_path=last "$@"

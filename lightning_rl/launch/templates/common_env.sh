# Rendezvous on the first node of the allocation. NodeAddr is the address SLURM itself uses to
# reach the node, so it resolves even where node names do not.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show node "$HEAD_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)}
# A fixed port per job: every rank computes the same one, and two jobs sharing a node differ.
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# NCCL over InfiniBand. Site values win: each setting is kept when already exported.
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-0}
export NCCL_IB_HCA=${NCCL_IB_HCA:-mlx5}
export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^lo,docker}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# Turn a stuck collective into an error with a stack trace instead of a silent hang.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# Since Slurm 22.05, srun does not inherit sbatch's --cpus-per-task: without this each rank gets one CPU, and its
# OMP_NUM_THREADS threads and data workers all share it.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-$SLURM_CPUS_PER_TASK}; fi

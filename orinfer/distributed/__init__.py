"""Tensor parallelism over the GPUs of one host (torch.distributed: NCCL on GPUs, gloo on the CPU).

One process per rank; rank 0 is the engine's own process (scheduler, sampler, everything the host does) and runs its
shard of the model; ranks 1..N-1 are worker processes that run only their shards' forwards, in lock-step with it:

  group.py     the rank's place in the group and its collectives (all-reduce, vocab all-gather, broadcast)
  lamport.py   the symmetric-memory buffers of the barrier-free all-reduce (the default)
  norm_fold.py that all-reduce folded into the RMSNorm that adds a block's output to the residual
  sharding.py  which weights split how (a model class's `tensor_parallel_plan`), the per-rank config and the
               checkpoint slice each rank reads
  mirror.py    rank 0's side of every model call: the call and its input tensors go to the workers first
  worker.py    a worker process: builds its shard and runner, then replays rank 0's calls
  executor.py  starts, watches and stops the workers
"""

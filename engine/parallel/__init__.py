"""Tensor parallelism: one engine worker's language model over N ranks (processes) on one host.

Rank 0 is the worker the rest of EPD sees; ranks 1..N-1 are followers it starts, running
only the model on their shard. docs/decisions/tensor-parallelism.md says how and why.

    shard.py           `Shard`: a rank's heads, MLP rows and vocabulary run; what it reads of a checkpoint
    layers.py          row-parallel linears, vocab-parallel embedding and head; `parallelize` swaps them in
    comm.py            `GroupComm`: the gloo group, all-reduce and all-gather with deadlines; `GroupFailed`
    step_channel.py    rank 0 -> followers: each step's op and tensors over ZeroMQ
    forward_inputs.py  a forward's inputs as one step, and back into a `ForwardBatch`
    leader.py          rank 0: `start_group`, `TensorParallelLM` (the model the runner holds)
    follower.py        ranks 1..N-1: load the shard, meet the group, run the steps
"""

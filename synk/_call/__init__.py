"""One call's path through synk.

::

    args            bind the call's arguments; stage plain arrays in shared memory; plan the
                    split (batch=, local_batch=)
    rows            which rows each rank takes, and in which pieces
    runner          a rank's share: take its rows, run fn slice by slice, combine the slices
    placement       a GPU rank's share: inputs onto its device (copies overlapping compute),
                    outputs left there
    device_ops      a GPU rank's outputs: device arrays, their kinds, their copies to the host
    outputs         the end of every rank's share: outputs handed on to be combined, as the
                    rank's communicator says (collectives, or replies the master combines)
    device_collect  combine the ranks' outputs on the devices (NCCL), into rank 0
    residency       each GPU rank's copies of Data resident on the devices
    collect         combine the ranks' shares in the master (in place for large outputs)
    ops             a function's outputs and their ops: checks, combining slices and parts
    profile         per-call timing (and bytes moved) of the parts of a call
"""

"""The NCCL communicator: device arrays on the GPUs, through ``cupy.cuda.nccl``.

::

    nccl_comm.NcclCommunicator   the Communicator of device arrays
      nccl_setup                 joining: the id, NCCL's environment, every connection made
                                 at set-up
      nccl_guard                 every NCCL call ordered on the caller's stream, watched,
                                 aborted when a peer fails
      nccl_types                 NCCL's dtype and op tables (as cupyx.distributed's)
      nccl_gathered              the ops NCCL lacks: gathered, then combined on the device
"""

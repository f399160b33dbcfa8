"""One call's path through synk, in the order data meets it.

::

    master (rank 0)                                              worker rank r
    ---------------                                              -------------
    master.MasterCall.run   (over the group's Port: port)
      prepare   shipping  the function, again if what it captured changed
                inputs    bind the arguments; stage plain arrays in shared memory
                          (staging); plan the rows (rows); a bound step's plain
                          values prepared once (bound_values)
      send      a ShareTask per rank (records), one CALL  ------->  ShareTask.from_wire
                (a bound step's values only until the        (bound_values.WorkerKept)
                workers keep them; its call passing nothing
                more, its number alone once they keep its task)
                (across_hosts under MPI: rows to other hosts)
      own share share.run  <------------------ the same code ------>  share.run
                  a CPU rank: its rows, fn piece by piece, slices combined (ops)
                  a GPU rank: inputs onto the device, outputs left there
                  finish: outputs left for the master (collect), combined on the
                  devices (collect), or by MPI's collectives (mpi_collect)
      replies   <------------------------- Share (records), as a plain tuple
      combine   collect.Combiner: the reduce ops (synk._reduction); from five ranks a
                second round in which every rank combines a chunk

A submitted call (``master.CallFuture``) stops after its own share: its replies and combine
wait in the group's ``Outstanding`` until a result is asked for, while the next call is sent.

The rooms, by job:

    master          the master's call, waited for or submitted
    port            what a call needs of its group (the engine's side, named once)
    shipping        functions shipped, and again when what they captured changed
    inputs          a call's arguments bound, staged and encoded
    staging         the shared-memory blocks of a function's plain-array arguments
    bound_values    a bound step's values, kept by the master and by the workers
    rows            which rows each rank takes, in which pieces
    records         the messages of one call (ShareTask, Share), their wire form
    share           a rank's share, the same on every rank and back end
    ops, frames     outputs and their reduce ops; torch tensors and JAX arrays
    collect         outputs combined on one host (by the master, or on the devices)
    mpi_collect     outputs combined across hosts by MPI's collectives
    across_hosts    under MPI, the rows other hosts read
    kept            what ranks keep between calls: replicas, Data on the devices
    replica_tensors a shared torch module's tensors over each rank's replicas
    profile         per-call timing

Nothing here imports the engine: what a call needs of its group is the ``Port``.
"""

"""One call's path through synk, in the order data meets it. Nothing here imports the
engine: what a call needs of its group comes through its ``Port`` (``port``)::

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
"""

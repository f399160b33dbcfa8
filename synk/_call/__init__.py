"""One call's path through synk, in the order data meets it.

::

    master (rank 0)                                              worker rank r
    ---------------                                              -------------
    master.MasterCall.run   (over the group's Port: port.py)
      prepare   shipping  the function, again if what it captured changed
                          (captures, reachable, by_value)
                args      bind the arguments; stage plain arrays in shared
                          memory (staging); plan the rows (rows); a bound
                          step's plain values prepared once (bound)
      send      a ShareTask per rank (records), one CALL  ------->  ShareTask.from_wire
                (a bound step's values only until the               (bound.WorkerKept)
                workers keep them; its call passing nothing
                more, its number alone once they keep its task)
                (across_hosts under MPI: rows to other hosts)
      own share rank_share.run  <------------- the same code ------>  rank_share.run
                  runner: rows, fn piece by piece (piece), slices combined (ops)
                  placement: on a GPU rank, inputs onto the device, outputs left there
                  outputs.finish: outputs into the rank's OutputSink (exports,
                  remote), or combined on the devices (device_collect)
      replies   <------------------------- Share (records), as a plain tuple
      combine   collect.Combiner: the reduce ops (synk._reduction); from five ranks a
                second round in which every rank combines a chunk

A submitted call (``submitted``) stops after its own share: its replies and combine wait
in the group's ``Outstanding`` until a result is asked for, while the next call is sent.

Besides: ``replicas`` (the shared variables' replicas and their collectives),
``replica_tensors`` (a shared torch module's tensors over each rank's replicas: made when a
function that captures it is shipped, pointed at the replicas at each share), ``residency``
(Data kept on the devices), ``device_ops`` (a GPU rank's outputs), ``profile`` (per-call
timing). Nothing here imports the engine: what a call needs of its group is the ``Port``.
"""

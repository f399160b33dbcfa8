"""One call's path through synk, in the order data meets it.

::

    master (rank 0)                                              worker rank r
    ---------------                                              -------------
    master.MasterCall.run   (over the group's Port: port.py)
      prepare   shipping  the function, again if what it captured changed
                          (captures, reachable, by_value)
                args      bind the arguments; stage plain arrays in shared
                          memory (staging); plan the rows (rows); or reuse the
                          function's last arguments (templates)
      send      a ShareTask per rank (records), one CALL  ------->  ShareTask.from_wire
                (the number of a template the workers keep;         (templates.Kept)
                a repeat of the last call: its bytes again)
                (across_hosts under MPI: rows to other hosts)
      own share rank_share.run  <------------- the same code ------>  rank_share.run
                  runner: rows, fn piece by piece (piece), slices combined (ops)
                  placement: on a GPU rank, inputs onto the device, outputs left there
                  outputs.finish: outputs into the rank's OutputSink (exports,
                  remote), or combined on the devices (device_collect)
      replies   <------------------------- Share (records), as a plain tuple
      combine   collect.Combiner: the reduce ops (synk._reduction); from five ranks a
                second round in which every rank combines a chunk

Besides: ``replicas`` (the shared variables' replicas and their collectives), ``residency``
(Data kept on the devices), ``device_ops`` (a GPU rank's outputs), ``profile`` (per-call
timing). Nothing here imports the engine: what a call needs of its group is the ``Port``.
"""

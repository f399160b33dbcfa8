"""One call's path through synk (docs/architecture.md, "One call"). Nothing here imports the
engine: what a call needs of its group comes through its ``Port`` (``port``)::

    master (rank 0): master.MasterCall.run                        worker rank r
      prepare   shipping, inputs (staging, rows, bound_values)
      send      a ShareTask per rank (records), one CALL ------->  ShareTask.from_wire
                (across_hosts under MPI: rows to other hosts)
      own share share.run  <------- the same code ------------->  share.run
                finish: outputs to the master (collect), combined on the devices
                (collect), or by MPI's collectives (mpi_collect)
      replies   <---------------------- Share (records), a plain tuple
      combine   collect.Combiner (synk._reduction); from five ranks a second round
"""

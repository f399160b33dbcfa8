"""The engine: the master's group of worker processes and the worker's side of it.

::

    master (rank 0)                                   worker rank r
    ---------------                                   -------------
    group.Group  -- spawn, key via watch pipe ----->  worker.main: read the key
                 <-- HMAC challenge, both ways ---->  (auth; nothing unpickled before)
                 -- protocol.Init ----------------->  worker_state.WorkerState
                 -- CALL / SHIP / SHARED / REDUCE ->  link.Link; WorkerState.handle: a
                                                      handler per request, its reply
                 <-- OK | ERR | EOF on death -------
    channel.Channel  (master) and link.Link (worker): after Init, messages that fit go
                 through ring.Ring, a shared-memory ring per worker, polled (waiting.Waiter:
                 poll, yield, sleep, adapted to recent waits); the socket carries wake-ups,
                 larger messages and EOF, and a pidfd per worker shows its death
    watchdog     interrupts the master's own share on a death or timeout
    spawn        the workers' command line, and the thread they are started from
    local_launch, mpi_launch
                 how the workers start, die and stop: a strategy Group is given (the
                 master's children on its host; or the processes of an MPI job, mpi;
                 launcher: ending Open MPI's launcher when it waits for a vanished host)
    state        the running group
    (below the engine, in synk._wire: protocol, the messages and their codec (requests
    and replies built by name, failures read back); shm, shared-memory segments and their
    owners' locks; ring and waiting, as above; arrays, how arrays travel inside messages)
    A call's share runs in _call.rank_share, the same code on the master and the workers,
    and ends in _call.outputs.finish: the outputs go into the reply (large ones left in
    shared memory, Group.export_outputs / WorkerState.export_outputs) for the master to
    combine (_call.collect), or are combined on the devices, as the communicator says.
"""

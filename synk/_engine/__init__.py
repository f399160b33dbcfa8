"""The engine: the master's group of worker processes and the worker's side of it.

::

    master (rank 0)                                   worker rank r
    ---------------                                   -------------
    group.Group  (the Port a call runs through)
      launch  -- spawn, key via watch pipe ------->  worker.main: read the key
              <-- HMAC challenge, both ways ----->  (auth; nothing unpickled before)
              -- protocol.Init ------------------>  worker_state.WorkerState
      messaging -- CALL / SHIP / SHARED / REDUCE ->  link.Link; WorkerState.handle: a
                                                     handler per request, its reply
              <-- OK | ERR | EOF on death --------
      watchdog   interrupts the master's own share on a death or the deadline
      health     broken or closed: the one way to fail or stop the group

A ``Group`` is made of parts (see ``group``): the launch's ``Workers`` (processes, channels,
death descriptors, rings: ``workers``) and ``Started`` record (``launch``), a ``CallClock``
(``clock``), ``Health`` (``health``), ``Messaging`` (``messaging``), ``DeviceComms``
(``comm_join``) and the call blocks of ``_call.collect``. The launch is a strategy:
``local_launch`` (the master's children on its host, started from ``spawn``'s thread) or
``mpi_launch`` (the processes of an MPI job: ``mpi``, ``hosts``; ``launcher`` ends Open
MPI's launcher when it waits for a vanished host). ``channel`` (master) and ``link``
(worker): messages that fit go through a shared-memory ring per worker (``_wire.ring``),
polled (``_wire.waiting``); the socket carries wake-ups, larger messages and EOF, and a
pidfd per worker shows its death.

A call's path is ``synk._call``'s (``MasterCall``, the same ``rank_share`` on every rank);
the engine gives it the ``Port`` and runs a worker's share of it (``WorkerState``).
"""

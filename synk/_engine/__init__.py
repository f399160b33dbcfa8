"""The engine: the master's group of worker processes (``group.Group``, the ``Port`` a call
runs through) and the worker's side (``worker_state.WorkerState`` runs its share)::

    master (rank 0)                                   worker rank r
    group.Group
      launch  -- spawn, key via watch pipe ------->  worker.main: read the key
              <-- HMAC challenge, both ways ----->  (auth; nothing unpickled before)
              -- protocol.Init ------------------>  worker_state.WorkerState
      messaging -- CALL / SHIP / SHARED / REDUCE ->  link.Link; WorkerState.handle
              <-- OK | ERR | EOF on death --------
"""

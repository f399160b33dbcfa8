"""The wire, below every other layer: how bytes and arrays move between synk's processes, in
``protocol`` (the control messages), ``ring`` (a shared-memory ring between two processes),
``waiting`` (how a thread waits for one: poll, yield, sleep), ``arrays`` (arrays inside
messages: by name in shared memory, or as bytes), ``shm`` and ``sparse`` (shared-memory
segments and their owners' locks), ``data_updates`` (what the ranks hear of ``synk.Data``) and
``interfaces`` (this machine's network addresses).
"""

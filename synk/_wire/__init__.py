"""The wire: how bytes and arrays move between synk's processes, below every other layer.

``shm`` (shared-memory segments and their owners' locks), ``ring`` (a shared-memory ring
between two processes), ``waiting`` (how a thread waits for one: poll, yield, sleep) and
``arrays`` (arrays inside messages: by name in shared memory, or as bytes).
"""

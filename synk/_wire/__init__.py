"""The wire, below every other layer: how bytes and arrays move between synk's processes:
``protocol`` (control messages), ``ring`` (a shared-memory ring between two processes),
``waiting`` (poll, yield, sleep), ``arrays`` (arrays in messages), ``shm`` and ``sparse``
(segments and their owners' locks), ``data_updates`` (what the ranks hear of ``synk.Data``)
and ``interfaces`` (this machine's network addresses).
"""

"""``synk.comm``'s collectives, one module per family. Each module holds the whole of its
operations: the user functions, their checks, their dispatch to the rank's communicator
(``route``: the host one, NCCL, or the staged one, all of ``communicator.Communicator``),
and their adjoints for torch and JAX (``autograd.rules``' ``Rule``, registered by name).

::

    allreduce        allreduce (one array, or a structure fused), reduce
    broadcast        broadcast, scatter, and their object forms
    gather           allgather, gather, and their object forms
    reduce_scatter   reduce_scatter
    alltoall         alltoall
    scan             scan, exscan
    messages         send, recv, sendrecv, probe (point to point)
    barrier          barrier

Each module's ``__all__`` are ``synk.comm``'s functions themselves, a collective numbered
where it is defined (``context.numbered``); a rule calls the functions it needs directly,
from its own module or one it imports (``reduce_scatter`` imports ``gather``; ``broadcast``
and ``scan`` import ``allreduce``; ``alltoall`` imports ``gather``).

Adding a collective: its function, checks and rule in its family's module (or a new one
here, in ``synk.comm``'s ``_FAMILIES``), its name in ``context.NAMES``, its method in
``communicator.Communicator`` and in each transport that does it natively (the others
inherit the one written over the interface in ``algorithms``), and its tests.
"""

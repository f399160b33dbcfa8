"""``synk.comm``'s collectives, one module per family, each whole: the user functions (its
``__all__``, ``context.numbered``), their checks, their dispatch (``route``) and their
adjoints (``autograd.rules``). How the families import each other, and what adding a
collective touches: docs/architecture.md.

::

    allreduce        allreduce (one array, or a structure fused), reduce
    broadcast        broadcast, scatter, and their object forms
    gather           allgather, gather, and their object forms
    reduce_scatter   reduce_scatter
    alltoall         alltoall
    scan             scan, exscan
    messages         send, recv, sendrecv, probe (point to point)
    barrier          barrier
    dispatch         what the families share: the hand-off to ``autograd``, ``out=``, the ops
"""

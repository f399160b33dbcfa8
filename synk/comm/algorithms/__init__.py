"""Collectives written once, above the ``Communicator`` interface, for every communicator.

::

    fused        allreduce of structures (one buffer per dtype), and the mean
    rooted       reduce, gather, scatter to and from one rank
    moves        broadcast and allgather of structures
    alltoall     alltoall, of lists and of split arrays
    loc          maxloc and minloc
    structures   how a structure's leaves travel (their specs and kinds)
    out          out=: where a result is written
    groups       sub-groups of a call's ranks (split, new_group)
"""

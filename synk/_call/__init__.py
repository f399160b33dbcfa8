"""One call's path through synk.

::

    args     bind the call's arguments; stage plain arrays in shared memory; plan the split
    runner   a rank's share: take its rows, run fn slice by slice, combine the slices
    collect  combine the ranks' shares in the master (in place for large outputs)
    ops      the reduce ops and how parts are combined
    profile  per-call timing of the parts of a call
"""

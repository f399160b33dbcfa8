"""One call's path through synk: master.MasterCall.run prepares (shipping, inputs), sends a
``records.ShareTask`` per rank, runs rank 0's share (``share.run``, the workers' code too), reads
the replies and combines them (``collect``); the picture is docs/architecture.md's "One call".
Nothing here imports the engine: what a call needs of its group comes through its ``Port``
(``port``)."""

"""The host communicator: numpy arrays between the ranks of a call, and device arrays staged
through it.

::

    host_comm.HostCommunicator   host arrays, over
      shm_mesh.Mesh              one host: socketpairs, shared-memory rings (mesh_wire),
                                 segments for large messages (shm_channel), a progress thread
      mpi_mesh.MpiMesh           many hosts: MPI's point-to-point messages
        mailbox, matching, aborts  (both:) per-(source, tag) mailboxes, wildcards, probes
      host_collectives           the collectives written over those messages
    staged_comm.StagedCommunicator  device arrays through HostCommunicator
"""

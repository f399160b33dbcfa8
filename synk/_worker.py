"""Worker entry point: ``python -m synk._worker CONTROL_FD WATCH_FD``. Receive, run, reply."""
from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import sys
import threading
from multiprocessing.connection import Connection


def _exit_when_master_dies(watch_fd: int) -> None:
    """The master never writes to this pipe; EOF means it is gone, so stop even mid-call."""
    def watch():
        while os.read(watch_fd, 1):
            pass
        os._exit(70)

    threading.Thread(target=watch, name="synk-master-watch", daemon=True).start()


def main(control_fd: int, watch_fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the master's to handle
    faulthandler.enable()
    _exit_when_master_dies(watch_fd)
    conn = Connection(control_fd)
    tag, init = pickle.loads(conn.recv_bytes())
    sys.path[:] = init.sys_path
    from synk import _worker_state, errors

    try:
        state = _worker_state.WorkerState(init)
        reply = ("ok", os.getpid())
    except BaseException as exc:
        state, reply = None, ("err", *errors.pack_exception(exc, init.rank))
    conn.send_bytes(pickle.dumps(reply))
    if state is None:
        return
    from synk._engine import poll

    poller = select.poll()
    poller.register(control_fd, select.POLLIN)
    while True:
        poll(poller, init.spin_s, None)
        try:
            data = conn.recv_bytes()
        except EOFError:
            break
        reply, more = state.handle(data)
        if not more:
            break
        conn.send_bytes(reply)
    state.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

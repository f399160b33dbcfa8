"""Hosts that share nothing, on one machine, for the tests of many hosts.

Each host is a set of Linux namespaces of its own: network (a veth pair to a bridge of the
test's, an address of a subnet of its own), mount table (a tmpfs on ``/dev/shm``, an
``/etc/hosts`` naming every host), process ids and hostname. One Open MPI job spans them over
TCP: ``mpiexec`` runs on the first host and starts its daemons on the others through an ssh
stand-in, which asks an agent in the test process (over a Unix socket at a path every host
sees) to run the command in that host's namespaces. Needs root, ``unshare``, ``nsenter``
and ``ip``; the tests skip, saying why, where they are missing.

Everything made here goes when ``close()`` runs, also after a failed test: each host's
processes die with the first process of its pid namespace (SIGKILL), its interfaces and
its ``/dev/shm`` with its namespaces, and the bridge is deleted.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

import synk

_SSH = """#!{python}
# ssh stand-in: [options] host command... -> the agent runs the command on that host
import json, socket, sys
args = sys.argv[1:]
while args and args[0].startswith("-"):
    args = args[2:] if args[0] in ("-o", "-p", "-l", "-i", "-F") else args[1:]
host, command = args[0], " ".join(args[1:])
agent = socket.socket(socket.AF_UNIX)
agent.connect({agent!r})
socket.send_fds(agent, [json.dumps([host, command]).encode()], [0, 1, 2])
code = agent.recv(16)
sys.exit(int(code or b"255"))
"""


# pid 1 of a host: reaps the processes left to it (the ssh stand-in's, once mpiexec is done)
_INIT = """
import os, time
while True:
    try:
        os.wait()
    except ChildProcessError:
        time.sleep(0.05)
"""


# this Python's bin/ first: Open MPI's mpiexec and prted of the mpi extra live there
_PATH = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
# the synk under test first: a job's ranks must import it, not the one this Python installed
_PYTHONPATH = os.pathsep.join(filter(None, [
    os.path.dirname(os.path.dirname(os.path.abspath(synk.__file__))),
    os.environ.get("PYTHONPATH")]))


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def why_not() -> str | None:
    """Why hosts apart cannot be made here, or None."""
    if os.geteuid() != 0:
        return "hosts that share nothing need root (network, mount and pid namespaces)"
    missing = [tool for tool in ("unshare", "nsenter", "ip") if shutil.which(tool) is None]
    if missing:
        return f"hosts that share nothing need {', '.join(missing)} (util-linux, iproute2)"
    return None


class JobRun:
    """An ``mpiexec`` run across the hosts: its exit status, output and duration."""

    def __init__(self, proc: subprocess.CompletedProcess, seconds: float) -> None:
        self.rc, self.out, self.err, self.seconds = (
            proc.returncode, proc.stdout, proc.stderr, seconds)

    def __repr__(self) -> str:
        return f"<mpiexec rc={self.rc} after {self.seconds:.1f} s>\n{(self.out + self.err)[-6000:]}"


class Hosts:
    """``count`` hosts that share nothing; ``names[i]`` is host i's hostname."""

    def __init__(self, count: int, workdir) -> None:
        self.workdir = str(workdir)
        tag = secrets.token_hex(3)
        self.bridge = f"skb{tag}"
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.names = [f"synk-h{i}" for i in range(count)]
        self.addresses = [f"{self.subnet}.{10 + i}" for i in range(count)]
        self.inits: list[int] = []  # each host's first process (pid 1 of its pid namespace)
        self._links: list[str] = []  # each host's end of its veth pair, on the bridge
        self._vanished: set[int] = set()
        self._held: list[socket.socket] = []  # the ssh sessions to vanished hosts
        self._unshares: list[subprocess.Popen] = []
        self._agent: socket.socket | None = None
        self._closed = False
        try:
            self._start(tag)
        except BaseException:
            self.close()
            raise

    # -- making them --------------------------------------------------------------------
    def _start(self, tag: str) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        hosts_file = os.path.join(self.workdir, "etc-hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{a} {n}\n" for a, n in zip(self.addresses, self.names))
        for i, name in enumerate(self.names):
            unshare = subprocess.Popen(
                ["unshare", "--net", "--mount", "--pid", "--uts", "--fork", "--mount-proc",
                 "--propagation", "private", sys.executable, "-c", _INIT],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                start_new_session=True)
            self._unshares.append(unshare)
            init = self._init_of(unshare)
            self.inits.append(init)
            outside, inside = f"skv{tag}{i}", f"skp{tag}{i}"
            self._links.append(outside)
            _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _sh("ip", "link", "set", inside, "netns", str(init))
            _sh("ip", "link", "set", outside, "master", self.bridge, "up")
            self.run(i, f"ip link set lo up && ip link set {inside} name eth0 && "
                        f"ip addr add {self.addresses[i]}/24 dev eth0 && ip link set eth0 up && "
                        f"hostname {name} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                        f"mount --bind {hosts_file} /etc/hosts", check=True)
        self._serve_agent()

    @staticmethod
    def _init_of(unshare: subprocess.Popen) -> int:
        """The pid (here) of the process that unshare forked into the new namespaces."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if unshare.poll() is not None:
                raise RuntimeError(f"unshare failed: {unshare.stderr.read().decode()}")
            try:
                with open(f"/proc/{unshare.pid}/task/{unshare.pid}/children") as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            time.sleep(0.01)
        raise RuntimeError("unshare did not start its process")

    def _enter(self, host: int) -> list:
        return ["nsenter", "-t", str(self.inits[host]), "-n", "-m", "-p", "-u", "--"]

    def run(self, host: int, command: str, check: bool = False, timeout: float = 30,
            env: dict | None = None) -> subprocess.CompletedProcess:
        """``command`` (a shell line) on host ``host``."""
        proc = subprocess.run([*self._enter(host), "/bin/sh", "-c", command], text=True,
                              capture_output=True, timeout=timeout, env=env)
        if check and proc.returncode:
            raise RuntimeError(f"on {self.names[host]}: {command}: {proc.stderr}")
        return proc

    # -- the ssh stand-in's agent ---------------------------------------------------------
    def _serve_agent(self) -> None:
        self._sockdir = tempfile.mkdtemp(prefix="synk-apart-")  # (a socket path is short)
        path = os.path.join(self._sockdir, "agent")
        self._agent = socket.socket(socket.AF_UNIX)
        self._agent.bind(path)
        self._agent.listen(16)
        self.ssh = os.path.join(self.workdir, "ssh")
        with open(self.ssh, "w") as f:
            f.write(_SSH.format(python=sys.executable, agent=path))
        os.chmod(self.ssh, 0o755)
        threading.Thread(target=self._agent_loop, name="apart-agent", daemon=True).start()

    def _agent_loop(self) -> None:
        while True:
            try:
                conn, _ = self._agent.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._agent_run, args=(conn,), daemon=True).start()

    def _agent_run(self, conn: socket.socket) -> None:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        host, command = json.loads(data)
        index = self.names.index(host) if host in self.names else -1
        self._agent_command(conn, fds, index, command)
        if index in self._vanished:  # as an ssh session to a machine that is gone: it
            self._held.append(conn)  # neither ends nor answers (until close())
        else:
            conn.close()

    def _agent_command(self, conn: socket.socket, fds: list, index: int, command: str) -> None:
        """Run ``command`` on host ``index`` with the ssh stand-in's stdin, stdout and
        stderr (``fds``), and send it the exit status (none from a vanished host)."""
        try:
            if index < 0:
                raise ValueError("no such host")
            env = dict(os.environ, TMPDIR=self._tmpdir(index), PATH=_PATH,
                       PYTHONPATH=_PYTHONPATH)
            proc = subprocess.Popen([*self._enter(index), "/bin/sh", "-c", command],
                                    stdin=fds[0], stdout=fds[1], stderr=fds[2], env=env)
        except Exception as err:
            os.write(fds[2], f"apart agent: {err}\n".encode())
            code = 255
        else:
            code = proc.wait()
        finally:
            for fd in fds:
                os.close(fd)
        if index not in self._vanished:
            with contextlib.suppress(OSError):
                conn.sendall(str(code).encode())

    # -- an MPI job across them -----------------------------------------------------------
    def start_mpiexec(self, script: str, ranks_per_host=2, env: dict | None = None,
                      env_launcher: dict | None = None, options=()) -> subprocess.Popen:
        """Start ``script`` (a path) under one ``mpiexec`` on host 0, with ``ranks_per_host``
        ranks on each host (or ``ranks_per_host[i]`` on host i; ranks in host order),
        ``env`` exported to every rank, ``env_launcher`` given to mpiexec alone and
        ``options`` added to its command line."""
        counts = (ranks_per_host if isinstance(ranks_per_host, (list, tuple))
                  else [ranks_per_host] * len(self.names))
        hosts = ",".join(f"{name}:{k}" for name, k in zip(self.names, counts))
        net = f"{self.subnet}.0/24"
        cmd = ["mpiexec", "--allow-run-as-root", "--host", hosts, "-n", str(sum(counts)),
               "--mca", "plm_rsh_agent", self.ssh, "--mca", "plm_rsh_no_tree_spawn", "1",
               "--mca", "oob_tcp_if_include", net, "--mca", "btl_tcp_if_include", net,
               *options]
        for var, value in (env or {}).items():
            cmd += ["-x", f"{var}={value}"]
        cmd += [sys.executable, script]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=self._tmpdir(0),
                        OMPI_MCA_btl_sm_backing_directory=self.workdir,
                        PATH=_PATH, PYTHONPATH=_PYTHONPATH)
        for var in ("SYNK_HOST_ID", "SYNK_MASTER_ADDR"):
            full_env.pop(var, None)
        full_env.update(env_launcher or {})  # the launcher's own settings
        return subprocess.Popen([*self._enter(0), *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=full_env,
                                cwd=self.workdir)

    def mpiexec(self, script: str, ranks_per_host=2, env: dict | None = None,
                timeout: float = 60, env_launcher: dict | None = None) -> JobRun:
        """``start_mpiexec``, waited for (``subprocess.TimeoutExpired`` past ``timeout``
        seconds, the job killed)."""
        start = time.monotonic()
        proc = self.start_mpiexec(script, ranks_per_host, env, env_launcher)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        return JobRun(done, time.monotonic() - start)

    def _tmpdir(self, host: int) -> str:
        """Host ``host``'s TMPDIR, where Open MPI keeps its session files (in /tmp, which
        the hosts share, a killed job's files would trouble the next job's)."""
        path = os.path.join(self.workdir, f"tmp-{self.bridge}-{self.names[host]}")
        os.makedirs(path, exist_ok=True)
        return path

    def vanish(self, host: int) -> None:
        """Host ``host`` disappears as a machine does when its power or network fails:
        its link goes down first (no packet leaves it, not even its sockets' last words),
        then every process of it dies."""
        self._vanished.add(host)
        _sh("ip", "link", "set", self._links[host], "down")
        os.kill(self.inits[host], 9)

    def shm(self, host: int) -> list:
        """What is in host ``host``'s ``/dev/shm``."""
        return sorted(self.run(host, "ls -A /dev/shm", check=True).stdout.split())

    def processes(self, host: int) -> list:
        """The host's processes other than its first (``pid, command`` lines)."""
        out = self.run(host, "ps -e -o pid=,args=", check=True).stdout.splitlines()
        return [line.strip() for line in out
                if line.split(None, 1)[0] != "1" and "ps -e -o" not in line
                and not line.strip().endswith("/bin/sh -c ps -e -o pid=,args=")]

    # -- the end ------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in self._held:
            conn.close()
        if self._agent is not None:
            self._agent.close()
            shutil.rmtree(self._sockdir, ignore_errors=True)
        for init in self.inits:
            try:
                os.kill(init, 9)  # pid 1 of its namespace: the kernel kills the rest
            except ProcessLookupError:
                pass
        for unshare in self._unshares:
            try:
                unshare.wait(timeout=10)
            except subprocess.TimeoutExpired:
                unshare.kill()
                unshare.wait()
            if unshare.stderr is not None:
                unshare.stderr.close()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def hosts_apart(tmp_path):
    """A factory of ``Hosts`` (``hosts_apart(2)``), all closed when the test ends."""
    why = why_not()
    if why:
        pytest.skip(why)
    made: list[Hosts] = []

    def make(count: int = 2) -> Hosts:
        try:
            made.append(Hosts(count, tmp_path))
        except (subprocess.CalledProcessError, RuntimeError, OSError) as err:
            detail = getattr(err, "stderr", "") or err
            pytest.skip(f"cannot make hosts that share nothing here: {detail}")
        return made[-1]

    try:
        yield make
    finally:
        for hosts in made:
            hosts.close()

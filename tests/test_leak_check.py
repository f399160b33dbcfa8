"""The leak check of conftest.py: a test that leaks is reported once, its leftovers are
cleaned up, and the tests after it are judged on their own (one leak, not hundreds of errors).

It runs a small pytest session in a fresh process, with a copy of conftest.py: a test that
leaks one of everything the check looks for, clean tests, a second leaking test (a leak
like an earlier one is still seen), and a last clean test."""
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from conftest import synk_segments

SESSION = '''\
import os
import subprocess
import threading
from pathlib import Path

import numpy as np
from conftest import synk_mappings, synk_segments

import synk

HERE = Path(__file__).parent
KEPT = []  # what the leaking tests hold on to, for the rest of the session


def leak_mapping_and_thread():
    KEPT.append(synk.data(np.arange(4.0)).array)  # keeps the block mapped after close()
    threading.Thread(target=threading.Event().wait, name="synk-leak", daemon=True).start()


def test_leaks():
    (HERE / "master.pid").write_text(str(os.getpid()))
    synk.fork(2)  # and no synk.close()
    KEPT.append(subprocess.Popen(["sleep", "60"]))
    (HERE / "child.pid").write_text(str(KEPT[-1].pid))
    with open(f"/dev/shm/synk-{os.getpid()}-leak", "wb") as f:  # named as synk names its
        f.write(bytes(64))  # segments (synk-<pid>-...), and never unlinked
    leak_mapping_and_thread()


def check_clean():
    assert not synk_segments(), "the leaking test's segments are still there"
    assert not os.path.exists(f"/proc/{(HERE / 'child.pid').read_text()}"), "its child runs"


def test_clean_0():
    check_clean()
    synk.fork(2)  # synk works again
    d = synk.data(np.arange(6.0))
    assert synk.function(lambda x: x.sum(), reduce="sum")(d) == 15
    synk.close()


def test_clean_1():
    check_clean()
    assert synk_mappings()  # (still held by KEPT: only not counted again)


def test_leaks_again():
    leak_mapping_and_thread()


def test_clean_2():
    check_clean()
'''

EXPECTED = {
    "test_leaks": ["left a synk group running", "left child processes behind",
                   "left shared-memory blocks behind", "still mapped after close()",
                   "synk threads still running"],
    "test_clean_0": [],
    "test_clean_1": [],
    "test_leaks_again": ["still mapped after close()", "synk threads still running"],
    "test_clean_2": [],
}


def test_a_leak_fails_only_the_test_that_leaked(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path)
    (tmp_path / "pytest.ini").write_text("[pytest]\ntimeout = 60\n")
    (tmp_path / "test_session.py").write_text(SESSION)
    report = tmp_path / "report.xml"
    try:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
             str(tmp_path), f"--junitxml={report}", "test_session.py"],
            cwd=tmp_path, capture_output=True, text=True, timeout=120,
        )
        outcomes = {}  # test -> its errors and failures (setup, call and teardown)
        for case in ET.parse(report).getroot().iter("testcase"):
            outcomes.setdefault(case.get("name"), []).extend(
                f"{e.tag}: {e.get('message')}" for e in case if e.tag in ("error", "failure"))
        assert list(outcomes) == list(EXPECTED), out.stdout
        for name, messages in EXPECTED.items():
            if not messages:
                assert not outcomes[name], out.stdout
                continue
            (problem,) = outcomes[name]  # reported once, as an error at its teardown
            assert problem.startswith("error:"), out.stdout
            for message in messages:
                assert message in problem, out.stdout
    finally:  # what the session may have left on the machine, had the check not cleaned up
        master, child = tmp_path / "master.pid", tmp_path / "child.pid"
        left = synk_segments([int(master.read_text())]) if master.exists() else set()
        for name in left:
            os.unlink(f"/dev/shm/{name}")
        if child.exists() and os.path.exists(f"/proc/{child.read_text()}"):
            os.kill(int(child.read_text()), 9)
    assert not left, f"the session left {left} in /dev/shm"

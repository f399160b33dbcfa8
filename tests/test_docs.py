"""The documentation cannot drift from the code.

* Every Python example in README.md and docs/*.md runs: the ```python blocks of one page
  run in order, in one fresh interpreter, as one script would, on 2 CPU ranks (the
  examples call ``synk.fork()`` with no ``n``; here that means 2 whatever the machine). A
  block that only illustrates (a fragment, or one that needs a GPU) is marked with the
  HTML comment ``<!-- not-run -->`` on the line before it, and is skipped.
* The API reference (docs/api.md) has an entry generated from the docstring of every
  public name, and every public name has a docstring.
* The signatures the README quotes are the code's.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

import synk

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = "<!-- not-run -->"
RANKS = 2
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")


@dataclasses.dataclass
class Block:
    """A fenced code block of a Markdown page."""

    path: pathlib.Path
    line: int  # of the block's first code line, counted from 1
    language: str
    code: str
    run: bool  # False when marked <!-- not-run -->


def fenced_blocks(path: pathlib.Path) -> list[Block]:
    """The fenced code blocks of the Markdown page at ``path``, in order."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        before = next((s.strip() for s in reversed(lines[:i]) if s.strip()), "")
        body, j = [], i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence[0] * len(fence))
            and lines[j].strip().strip(fence[0]) == ""
        ):
            line = lines[j]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{i + 1}: a code fence that is never closed")
        words = opening["info"].split()
        language = words[0].lstrip(".{").lower() if words else ""
        blocks.append(Block(path, i + 2, language, "\n".join(body) + "\n", before != NOT_RUN))
        i = j + 1
    return blocks


def runnable(path: pathlib.Path) -> list[Block]:
    return [b for b in fenced_blocks(path) if b.language in ("python", "py", "python3") and b.run]


# The driver run as __main__: it executes each block in __main__'s namespace, compiled
# under the page's name with the block's own line numbers, so a traceback points into the
# page. Functions the examples define live in __main__, as in a script, so synk ships them
# by value.
_DRIVER = """
import json, sys
import synk

_synk_fork = synk.fork


def _fork_on_doc_ranks(n=None, **kwargs):
    return _synk_fork({ranks} if n is None else n, **kwargs)


synk.fork = _fork_on_doc_ranks
for _synk_doc_path, _synk_doc_line, _synk_doc_code in json.loads(sys.argv[1]):
    exec(compile("\\n" * (_synk_doc_line - 1) + _synk_doc_code, _synk_doc_path, "exec"))
synk.close()
"""


def run_blocks(blocks: list[Block], cwd: pathlib.Path, timeout: float = 150):
    """Run ``blocks`` in order in one fresh interpreter: (exit code, stdout, stderr, pid)."""
    payload = json.dumps([[str(b.path), b.line, b.code] for b in blocks])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER.format(ranks=RANKS), payload], cwd=cwd, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    return proc.returncode, out, err, proc.pid


def _page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def _needs_framework(page: pathlib.Path) -> bool:
    return any(re.search(r"^\s*(import|from) (torch|jax)\b", b.code, re.M)
               for b in runnable(page))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.frameworks)
                                  if _needs_framework(p) else p
                                  for p in PAGES if runnable(p)], ids=_page_id)
def test_examples_run(page):
    blocks = runnable(page)
    for framework in ("torch", "jax"):  # (docs/frameworks.md: with synk's extras only)
        if any(re.search(rf"^\s*(import|from) {framework}\b", b.code, re.M) for b in blocks):
            pytest.importorskip(framework, reason=f"{_page_id(page)}'s examples need "
                                                  f"{framework}: pip install 'synk[{framework}]'")
    code, out, err, pid = run_blocks(blocks, cwd=ROOT, timeout=280)
    assert code == 0, f"an example in {_page_id(page)} failed:\n{out}\n{err}"
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"synk-{pid}-")]
    assert not left, f"the examples of {_page_id(page)} left shared memory behind: {left}"


def test_every_page_with_examples_runs_some():
    """The pages that hold the main examples keep at least one running block each."""
    for name in ("README.md", "docs/index.md", "docs/training.md", "docs/performance.md"):
        assert runnable(ROOT / name), f"{name} has no Python example that runs"


def test_collector_reads_fences_markers_and_lines(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- not-run -->\n```python\nnot python\n```\n"
        "\n* item\n\n  ```py\n  y = x + 1\n  ```\n\n```sh\nls\n```\n"
    )
    blocks = fenced_blocks(page)
    assert [(b.language, b.line, b.run) for b in blocks] == [
        ("python", 4, True), ("python", 9, False), ("py", 15, True), ("sh", 19, True),
    ]
    assert [b.code for b in runnable(page)] == ["x = 1\n", "y = x + 1\n"]


def test_a_failing_example_fails_with_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport synk\nn = synk.fork()\nassert n == 2, n\n```\n\n"
        "Text.\n\n```python\nassert synk.size() == 2\nraise KeyError('from the page')\n```\n"
    )
    code, out, err, _ = run_blocks(runnable(page), cwd=tmp_path, timeout=60)
    assert code != 0
    assert f'File "{page}", line 11' in err and "KeyError: 'from the page'" in err


def test_an_unclosed_fence_is_an_error(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks(page)


def _public_names() -> list[tuple[str, object]]:
    names = [(f"synk.{n}", getattr(synk, n)) for n in synk.__all__]
    names += [(f"synk.comm.{n}", getattr(synk.comm, n)) for n in synk.comm.__all__]
    return names + [("synk.errors.RemoteTraceback", synk.errors.RemoteTraceback)]


def test_api_reference_has_an_entry_for_every_public_name():
    entries = set(re.findall(r"^::: ([\w.]+)", (ROOT / "docs/api.md").read_text(), re.M))
    missing = []
    for name, obj in _public_names():
        # where a name shadows its own module (synk.function, synk.data, synk.shared), the
        # entry names the object inside that module
        defined = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
        if name not in entries and defined not in entries:
            missing.append(name)
    assert not missing, f"docs/api.md has no '::: NAME' entry for {missing}"


def test_every_public_name_has_a_docstring():
    # its own docstring: inspect.getdoc would fall back to a base class's
    undocumented = [name for name, obj in _public_names() if not (obj.__doc__ or "").strip()]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def _plain_signature(fn) -> str:
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_signatures_quoted_in_the_readme_match_the_code():
    """A quote with defaults (``synk.fork(n=None, *, backend="auto")``) claims the whole
    signature; one without (``synk.shared(value)``) or with ``...`` only shows a use."""
    quoted = [(name, text) for name, text in
              re.findall(r"`synk\.(\w+)(\([^`]*=[^`]*\))`", (ROOT / "README.md").read_text())
              if "..." not in text]
    assert len(quoted) >= 4, quoted
    for name, text in quoted:
        want = _plain_signature(getattr(synk, name)).replace("'", '"')
        assert text == want, f"README.md quotes synk.{name}{text}; the code has {want}"

"""The documentation cannot drift from the code.

* Every Python example in README.md and docs/ (docs/api/ included) runs: the ```python
  blocks of one page run in order, in one fresh interpreter, as one script would, on 2 CPU
  ranks (the examples call ``synk.fork()`` with no ``n``; here that means 2 whatever the
  machine). A block that only illustrates (a fragment, or one that needs a GPU) is marked with the
  HTML comment ``<!-- not-run -->`` on the line before it, and is skipped.
* The API reference (the pages of docs/api/) has one entry for every public name, written
  out in its page from its signature and docstring (``tests/api_reference.py``), each the
  code's as it is now; every public name has a docstring.
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

import api_reference
import pytest

import synk
import synk.simulator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
API_PAGES = api_reference.pages()  # docs/api/*.md
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
    for name in ("README.md", "docs/start.md", "docs/index.md", "docs/training.md",
                 "docs/performance.md"):
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
    names += [(f"synk.simulator.{n}", getattr(synk.simulator, n)) for n in synk.simulator.__all__]
    return names + [("synk.errors.RemoteTraceback", synk.errors.RemoteTraceback)]


def test_api_reference_has_an_entry_for_every_public_name():
    assert len(API_PAGES) >= 8, API_PAGES
    where: dict = {}
    for page in API_PAGES:
        for spec, _, _ in api_reference.entries(page.read_text()):
            where.setdefault(spec.split()[0], []).append(_page_id(page))
    missing = [name for name, _ in _public_names() if name not in where]
    assert not missing, f"no page of docs/api/ has a '<!-- reference: NAME -->' entry for {missing}"
    twice = {name: pages for name, pages in where.items() if len(pages) > 1}
    assert not twice, f"entries there more than once: {twice}"


@pytest.mark.parametrize("page", API_PAGES, ids=_page_id)
def test_api_reference_is_readable_as_a_file_and_is_the_codes(page):
    """A page of docs/api/ reads as a reference without the built site: its entries are
    written out in the file, not ``::: synk.fork`` placeholders, and each must be what
    ``tests/api_reference.py`` writes from the code now, its links made from that page (run
    it after changing a signature or a docstring)."""
    text = page.read_text()
    assert not re.search(r"^::: ", text, re.M), "a mkdocstrings placeholder is left"
    assert not re.search(r"\]\[synk\.", text), "a link only mkdocstrings resolves is left"
    stale = [spec for spec, body, _ in api_reference.entries(text)
             if body != api_reference.render(spec, page)]
    assert not stale, (f"{_page_id(page)}'s entries {stale} differ from the code: run "
                       "python tests/api_reference.py")


def test_api_reference_links_are_made_from_the_entrys_page():
    """A docstring's links are written from docs/; in an entry they are the page's own, and
    their headings exist."""
    calls, errors = ROOT / "docs/api/calls.md", ROOT / "docs/api/errors.md"
    text = "[a](api/calls.md#timeouts) [b](gpu.md#set-up) [c](api/data.md) `[d](x.md#y)`"
    assert api_reference.relinked(text, errors) == (
        "[a](calls.md#timeouts) [b](../gpu.md#set-up) [c](data.md) `[d](x.md#y)`")
    assert api_reference.relinked("[a](api/calls.md#timeouts)", calls) == "[a](#timeouts)"
    with pytest.raises(AssertionError, match="calls.md does not have"):
        api_reference.relinked("[a](api/calls.md#no-such-heading)", calls)


def _written_signatures(text: str) -> dict:
    """{name: the signature written in its entry}, from the page itself."""
    found = {}
    for _, body, _ in api_reference.entries(text):
        for code in re.findall(r"^```python\n(synk[\w.]*\(.*?)^```$", body, re.S | re.M):
            found[code.split("(", 1)[0]] = code.strip()
    return found


def test_api_reference_signatures_equal_the_code():
    """Read back from the page (not from the writer), every signature has the parameters
    of ``inspect.signature``: the same names, kinds and which have defaults."""
    import ast

    written = {}
    for page in API_PAGES:
        written.update(_written_signatures(page.read_text()))
    assert "synk.fork" in written and "synk.comm.allreduce" in written
    assert len(written) >= 70, sorted(written)
    for name, sig in written.items():
        obj = api_reference.resolve(name)
        owner, member = name.rsplit(".", 1)
        owner = api_reference.resolve(owner)
        method = False
        if inspect.isclass(owner):  # a method: the function in the class, self or cls first
            raw = vars(owner)[member]
            obj = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            method = not isinstance(raw, staticmethod)
        tree = ast.parse(f"def _{sig[sig.index('('):]}: pass")
        args = tree.body[0].args
        shown = [(a.arg, "POSITIONAL_OR_KEYWORD") for a in args.args] + (
            [(args.vararg.arg, "VAR_POSITIONAL")] if args.vararg else []) + [
            (a.arg, "KEYWORD_ONLY") for a in args.kwonlyargs] + (
            [(args.kwarg.arg, "VAR_KEYWORD")] if args.kwarg else [])
        target = obj.__init__ if inspect.isclass(obj) else obj
        params = list(inspect.signature(target).parameters.values())
        if inspect.isclass(obj) or method:
            params = params[1:]  # (self)
        assert shown == [(p.name, p.kind.name) for p in params], (name, sig)
        defaults = len(args.defaults) + sum(d is not None for d in args.kw_defaults)
        assert defaults == sum(p.default is not p.empty for p in params), (name, sig)


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


def test_reduce_none_with_several_outputs_is_documented_with_an_example():
    """``reduce=None`` results of a tuple-returning function are one list per output, not one
    tuple per rank. The introduction shows what comes back, in an example that runs
    (``test_examples_run``), and the reference and ``synk.function``'s docstring say it."""
    intro = [b.code for b in runnable(ROOT / "docs/index.md")]
    assert any("reduce=None" in code and "zip(*f(x))" in code for code in intro)
    assert "### `reduce=None` with several outputs" in (ROOT / "docs/index.md").read_text()
    assert "**Each output has its own list**" in (ROOT / "docs/api/calls.md").read_text()
    assert "not one tuple per rank" in inspect.getdoc(synk.function)

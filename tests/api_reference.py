"""The API reference's entries (docs/api/*.md), written out in markdown from the code itself,
so that the pages read as the reference where people read them (an editor, GitHub) and the
site shows the same, and neither can drift from the code: ``tests/test_docs.py`` checks that
every entry is what this module writes from the live signature and docstring.

An entry in a page is the text between two comments, which neither the site nor GitHub
shows::

    <!-- reference: synk.fork -->
    ...written by this module...
    <!-- end reference -->

with options after the name: ``members=a,b`` (the members of a class shown; default: every
public method and property defined in it; ``members=none``: none), ``init`` (show the
class's constructor signature), ``level=N`` (the heading's level; default 3).

    python tests/api_reference.py      # rewrite the entries of every page of docs/api/

A docstring is Google-style: ``Args:``, ``Returns:``, ``Raises:`` and ``Attributes:``
sections become lists; ````code```` becomes `code`; an indented block in the text is a code
example (shown, not run by the docs tests); links are markdown already. A docstring's links
to other pages are written from docs/ (``gpu.md#device-resident-data``,
``api/calls.md#timeouts``), and the entry has them from its own page
(``../gpu.md#device-resident-data``, ``calls.md#timeouts``).
"""
from __future__ import annotations

import inspect
import os
import pathlib
import re
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
API = DOCS / "api"
NOT_RUN = "<!-- not-run -->"
WIDTH = 92  # a signature longer than this is laid out one parameter per line
_ENTRY = re.compile(r"^<!-- reference: (?P<spec>[^>]*?) -->\n(?P<body>.*?)^<!-- end reference -->$",
                    re.S | re.M)
_SECTIONS = {"Args": "Parameters", "Arguments": "Parameters", "Returns": "Returns",
             "Raises": "Raises", "Attributes": "Attributes", "Yields": "Yields"}


def pages() -> list[pathlib.Path]:
    """The pages of the API reference, docs/api/*.md."""
    return sorted(API.glob("*.md"))


def entries(text: str) -> list[tuple[str, str, str]]:
    """(spec, body, whole match) of every entry in ``text``."""
    return [(m["spec"], m["body"], m[0]) for m in _ENTRY.finditer(text)]


def resolve(name: str):
    """The object a dotted public name stands for (``synk.comm.allreduce``)."""
    import synk

    parts = name.split(".")
    assert parts[0] == "synk", name
    obj = synk
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def render(spec: str, page: pathlib.Path | None = None) -> str:
    """The markdown of the entry ``spec`` (a name, then options); on ``page``, its links
    made relative to that page (see the module's docstring)."""
    text = _render(spec)
    return text if page is None else relinked(text, page)


def _render(spec: str) -> str:
    name, *options = spec.split()
    opts = dict(o.split("=", 1) if "=" in o else (o, "") for o in options)
    level = int(opts.get("level", 3))
    obj = resolve(name)
    if inspect.ismodule(obj):
        return _block(f"{'#' * level} module `{name}`", _doc(obj))
    if inspect.isclass(obj):
        return _class(name, obj, level, opts)
    if callable(obj):
        return _block(f"{'#' * level} `{name}()`", _signature(name, obj), _doc(obj, obj))
    return _block(f"{'#' * level} `{name}`", f"`{name} = {obj!r}`: {_comment(name)}")


def _class(name: str, cls, level: int, opts: dict) -> str:
    kind = "exception" if issubclass(cls, BaseException) else "class"
    parts = [f"{'#' * level} {kind} `{name}`"]
    if "init" in opts:
        parts.append(_signature(name, cls))
    if cls.__bases__ != (object,):
        bases = ", ".join(f"`{_public_name(b)}`" for b in cls.__bases__)
        parts.append(f"Bases: {bases}")
    parts.append(_doc(cls))
    chosen = opts.get("members")
    if chosen == "none":
        names = []
    elif chosen is not None:
        names = chosen.split(",")
    else:
        names = [n for n, v in vars(cls).items() if not n.startswith("_")
                 and (inspect.isfunction(v) or isinstance(v, (property, staticmethod,
                                                              classmethod)))]
    for member in names:
        raw = vars(cls)[member]
        qual = f"{name}.{member}"
        if isinstance(raw, property):
            parts.append(_block(f"{'#' * (level + 1)} `{qual}` (property)", _doc(raw.fget)))
            continue
        fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
        drop = not isinstance(raw, staticmethod)
        parts.append(_block(f"{'#' * (level + 1)} `{qual}()`",
                            _signature(qual, fn, drop_first=drop), _doc(fn, fn, drop)))
    return _block(*parts)


def _public_name(cls) -> str:
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    import synk

    for space, prefix in ((synk, "synk"), (synk.comm, "synk.comm"), (synk.errors, "synk.errors")):
        if getattr(space, cls.__name__, None) is cls:
            return f"{prefix}.{cls.__name__}"
    return f"{module}.{cls.__qualname__}"


def _block(*parts: str) -> str:
    return "\n\n".join(p.strip("\n") for p in parts if p and p.strip()) + "\n"


def _comment(name: str) -> str:
    """The comment on the line that defines the constant ``name`` in synk.comm."""
    short = name.rsplit(".", 1)[1]
    for source in ("comm/__init__.py", "comm/collectives/messages.py", "comm/host/mailbox.py"):
        text = (ROOT / "synk" / source).read_text()
        found = re.search(rf"^{short} = [^#\n]*#:? *(.+)$", text, re.M)
        if found:
            return _code(found[1].strip())
    raise AssertionError(f"no comment describes {name}")


# -- signatures ---------------------------------------------------------------------------
def _annotation(annotation) -> str:
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


def _default(value) -> str:
    if isinstance(value, str) and '"' not in value:
        return f'"{value}"'
    if type(value) is object:  # a sentinel: "not given"
        return "..."
    return repr(value)


def signature_text(name: str, fn, drop_first: bool = False) -> str:
    """``name(parameters) -> returns`` as the code declares it (string annotations as
    written), laid out one parameter per line when long."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    if inspect.isclass(fn):
        sig = inspect.signature(fn.__init__)
        params = list(sig.parameters.values())[1:]
    shown, starred = [], False
    for i, p in enumerate(params):
        if p.kind is p.KEYWORD_ONLY and not starred:
            shown.append("*")
            starred = True
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, starred = "*" + p.name, True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
        if p.annotation is not p.empty:
            text += ": " + _annotation(p.annotation)
        if p.default is not p.empty:
            text += (" = " if p.annotation is not p.empty else "=") + _default(p.default)
        shown.append(text)
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params)
                                            or params[i + 1].kind is not p.POSITIONAL_ONLY):
            shown.append("/")
    returns = ""
    if sig.return_annotation is not sig.empty and not inspect.isclass(fn):
        returns = " -> " + _annotation(sig.return_annotation)
    one_line = f"{name}({', '.join(shown)}){returns}"
    if len(one_line) <= WIDTH:
        return one_line
    return f"{name}(\n" + "".join(f"    {s},\n" for s in shown) + f"){returns}"


def _signature(name: str, fn, drop_first: bool = False) -> str:
    return f"{NOT_RUN}\n```python\n{signature_text(name, fn, drop_first)}\n```"


# -- docstrings ---------------------------------------------------------------------------
def _code(text: str) -> str:
    return text.replace("``", "`")


def _doc(obj, fn=None, drop_first: bool = False) -> str:
    """``obj``'s own docstring as markdown (its sections as lists; with ``fn``, each
    documented parameter with its type and default)."""
    raw = obj.__doc__ or ""
    lines = inspect.cleandoc(raw).splitlines()
    text, sections, current = [], {}, None
    for line in lines:
        head = line.rstrip(":")
        if line.endswith(":") and head in _SECTIONS and not line.startswith(" "):
            current = _SECTIONS[head]
            sections[current] = []
            continue
        if current is not None and (line.startswith(" ") or not line.strip()):
            sections[current].append(line)
            continue
        current = None
        text.append(line)
    out = [_text(text)]
    for title, body in sections.items():
        out.append(_section(title, body, fn, drop_first))
    return "\n\n".join(p for p in out if p)


def _text(lines: list) -> str:
    """Paragraphs as they are; an indented block after a blank line is a code example."""
    out, block = [], []

    def flush():
        if block:
            while block and not block[-1].strip():
                block.pop()
            code = textwrap.dedent("\n".join(block)).strip("\n")
            out.extend(([""] if out and out[-1] else []) + [NOT_RUN, "```python", code, "```",
                                                             ""])
            block.clear()

    previous_blank = True
    in_list = False
    for line in lines:
        stripped = line.strip()
        if block:
            if not stripped or line.startswith("    "):
                block.append(line)
                continue
            flush()
        if line.startswith("    ") and previous_blank and not in_list:
            block.append(line)
            previous_blank = False
            continue
        if stripped.startswith(("* ", "- ")):
            in_list = True
        elif not stripped:
            in_list = False if previous_blank else in_list
        out.append(_code(line))
        previous_blank = not stripped
    flush()
    return "\n".join(out).strip("\n")


def _items(body: list) -> list[tuple[str, str]]:
    """(head, text) of each item of a section: ``head: text``, continued on deeper lines;
    an item without a head (a Returns section's text) has head ''."""
    body = textwrap.dedent("\n".join(body)).strip("\n").splitlines()
    items: list = []
    for line in body:
        if not line.strip():
            continue
        if not line.startswith(" "):
            head, sep, rest = line.partition(": ")
            if sep and re.fullmatch(r"[\w.\[\], |*]+", head):
                items.append([head, rest.strip()])
            else:
                items.append(["", line.strip()])
        else:
            items[-1][1] += " " + line.strip()
    return [(h, _code(t)) for h, t in items]


def _section(title: str, body: list, fn, drop_first: bool) -> str:
    items = _items(body)
    if title == "Returns" or title == "Yields":
        return f"**{title}**\n\n" + "\n\n".join(
            _wrapped(f"`{h}`: {t}" if h else t) for h, t in items)
    params = {}
    if title == "Parameters" and fn is not None:
        target = fn.__init__ if inspect.isclass(fn) else fn
        params = dict(list(inspect.signature(target).parameters.items())
                      [1 if drop_first or inspect.isclass(fn) else 0:])
    lines = []
    for head, text in items:
        p = params.get(head)
        about = []
        if p is not None and p.annotation is not p.empty:
            about.append(f"`{_annotation(p.annotation)}`")
        if p is not None and p.default is not p.empty:
            about.append(f"default `{_default(p.default)}`")
        described = f" ({', '.join(about)})" if about else ""
        lines.append(_wrapped(f"* `{head}`{described}: {text}", "  "))
    return f"**{title}**\n\n" + "\n".join(lines)


def _wrapped(text: str, indent: str = "") -> str:
    """``text`` wrapped at the page's width, on spaces only (links and names stay whole)."""
    return textwrap.fill(text, width=WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


# -- links -------------------------------------------------------------------------------
_LINK = re.compile(r"\]\((?P<target>(?:[\w./-]+\.md)?(?:#[\w-]+)?)\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(?P<text>.+?)[ \t#]*$", re.M)
_FENCED = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE = re.compile(r"(`[^`\n]*`)")


def slug(heading: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading of this markdown text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"\*\*(.+?)\*\*", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text.encode("ascii", "ignore").decode()).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code blocks), as mkdocs makes them."""
    found: set[str] = set()
    for m in _HEADING.finditer(_FENCED.sub("", text)):
        base = anchor = slug(m["text"])
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}_{n}"
        found.add(anchor)
    return found


def _relink(target: str, page: pathlib.Path) -> str:
    path, _, anchor = target.partition("#")
    found = DOCS / path if path else page
    if anchor and anchor not in anchors(found.read_text()):
        raise AssertionError(f"a docstring links to {target}, a heading that {found.name} "
                             "does not have")
    if found.resolve() == page.resolve() and anchor:
        return "#" + anchor
    rel = os.path.relpath(found, page.parent).replace(os.sep, "/")
    return rel + ("#" + anchor if anchor else "")


def relinked(text: str, page: pathlib.Path) -> str:
    """``text`` (an entry's markdown, links written from docs/) with its links written from
    ``page``; code blocks are left as they are."""
    def one(match) -> str:
        return f"]({_relink(match['target'], page)})" if match["target"] else match[0]

    def prose(chunk: str) -> str:  # inline code left as it is
        parts = _CODE.split(chunk)
        return "".join(p if i % 2 else _LINK.sub(one, p) for i, p in enumerate(parts))

    out, last = [], 0
    for block in _FENCED.finditer(text):
        out.append(prose(text[last:block.start()]))
        out.append(block[0])
        last = block.end()
    out.append(prose(text[last:]))
    return "".join(out)


# -- the pages ----------------------------------------------------------------------------
def written(text: str, page: pathlib.Path | None = None) -> str:
    """``text`` (a page of docs/api/) with every entry written afresh from the code."""
    def one(match) -> str:
        return (f"<!-- reference: {match['spec']} -->\n{render(match['spec'], page)}"
                "<!-- end reference -->")

    return _ENTRY.sub(one, text)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    total = 0
    for path in pages():
        path.write_text(written(path.read_text(), path))
        total += len(entries(path.read_text()))
    print(f"wrote the {total} reference entries of the {len(pages())} pages of {API}")

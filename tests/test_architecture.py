"""The package's layers (docs/architecture.md): a module imports only from its own layer or
lower ones, and no modules import each other in a circle, counting imports inside functions.

Layers, lowest first: the rules every layer uses (errors, settings, reduce ops, row split,
the process's state), the array kinds' adapters (torch, JAX), the wire (bytes, shared
memory, rings, waiting), devices, comm, the per-call path, the engine, the API. The
imports that break these rules today are listed below; a change that adds one fails here,
and a change that removes one must strike it from the list, so the list only shrinks."""
import ast
import pathlib

import synk

ROOT = pathlib.Path(synk.__file__).parent

LAYERS = [  # (layer, module prefixes), lowest first; the first prefix that matches wins
    ("rules", ["synk.errors", "synk._settings", "synk._reduction", "synk._float32_on_device",
               "synk._tree", "synk._shares", "synk._process", "synk._interrupts"]),
    ("arrays", ["synk._arrays"]),  # the frameworks' adapters: torch, JAX <-> numpy, CuPy
    ("wire", ["synk._wire"]),
    ("devices", ["synk._devices"]),
    ("comm", ["synk.comm"]),
    ("call", ["synk._call"]),
    ("engine", ["synk._engine"]),
    ("api", ["synk"]),
]

KNOWN_UPWARD: set = set()

COMM_FLOORS = [  # inside synk.comm, lowest first (docs/architecture.md, "The way of one
    # collective"): the transports, what is written once over their interface, the
    # gradients' machinery, the collectives; a floor imports nothing from a higher one
    ["synk.comm.host", "synk.comm.nccl"],
    ["synk.comm.algorithms"],
    ["synk.comm.autograd"],
    ["synk.comm.collectives"],
]

KNOWN_CIRCLES = {
    # the simulated cupy package mirrors CuPy's own, whose modules import the package
    frozenset({"synk._devices.sim.cupy.cuda", "synk._devices.sim.cupy.cuda.runtime"}),
    # (the array's operators find their ufuncs in the package; the modules that launch
    # kernels on arrays, the general mechanism for CuPy's names, user kernels and fft among
    # them, are in this circle for that reason)
    frozenset({"synk._devices.sim.cupy", "synk._devices.sim.cupy._functions",
               "synk._devices.sim.cupy._ndarray", "synk._devices.sim.cupy._ufuncs",
               "synk._devices.sim.cupy.linalg", "synk._devices.sim.cupy.random",
               "synk._devices.sim.cupy._generic", "synk._devices.sim.cupy._kernels",
               "synk._devices.sim.cupy.fft"}),
}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports() -> dict:
    """module -> the synk modules it imports (anywhere in it), resolved to modules."""
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name and target.startswith("synk"):
                    found.add(target)
        graph[name] = found
    return graph


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer")


def _upward(graph) -> set:
    """(importer, imported) where the imported module is in a higher layer (a package's
    own __init__ importing its modules is not upward)."""
    return {(a, b) for a, targets in graph.items() for b in targets
            if _layer(b) > _layer(a) and b != "synk"}  # (see _without_top)


def _circles(graph) -> set:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.add(frozenset(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_top(graph) -> dict:
    """The graph without imports of the top package ``synk`` (``import synk`` for its
    public names), which would put every module in one circle."""
    return {a: targets - {"synk"} for a, targets in graph.items()}


def test_no_new_upward_import():
    upward = _upward(_imports())
    new = upward - KNOWN_UPWARD
    assert not new, f"imports from a higher layer: {sorted(new)}"
    gone = KNOWN_UPWARD - upward
    assert not gone, f"fixed, so strike them from KNOWN_UPWARD: {sorted(gone)}"


def _floor(module: str) -> int | None:
    for i, prefixes in enumerate(COMM_FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def test_inside_comm_no_floor_imports_a_higher_one():
    graph = _imports()
    upward = sorted((a, b) for a, targets in graph.items() for b in targets
                    if _floor(a) is not None and _floor(b) is not None and _floor(b) > _floor(a))
    assert not upward, f"imports from a higher floor of synk.comm: {upward}"


def test_no_new_import_circle():
    circles = _circles(_without_top(_imports()))
    new = circles - KNOWN_CIRCLES
    assert not new, f"modules importing each other in a circle: {[sorted(c) for c in new]}"
    gone = KNOWN_CIRCLES - circles
    assert not gone, f"fixed, so strike them from KNOWN_CIRCLES: {[sorted(c) for c in gone]}"


def test_every_operation_of_synk_comm_has_the_code_its_rows_name_it_by():
    """A rank's row names the collective it is in by a code (``context.NAMES``): every
    operation of synk.comm that talks to other ranks has one, and every code names one."""
    import synk.comm
    from synk.comm import context

    operations = set(synk.comm._OPERATIONS)
    local = {"rank", "size", "average_gradients"}  # (its allreduces have their own codes)
    assert set(context.NAMES[1:]) <= operations, set(context.NAMES[1:]) - operations
    assert operations - local <= set(context.NAMES), operations - local - set(context.NAMES)
    assert len(context.NAMES) <= 64  # (six bits of a row's word)
    assert all(name in dir(synk.comm) for name in operations)

"""The layout's promises: imports flow one way, the package never imports tests/, no module imports itself through
others (no cycle), the library's top level stays at most 12 modules, the SGLang integration uses only the library's
public names, planning imports no run code, and the SGLang plugin (loaded by SGLang in every process) imports nothing
heavy."""
import ast
import importlib
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (folder, top-level modules its files may not import, relative imports into these subpackages forbidden)
RULES = [
    ("profiling", {"graphs", "compiled_attn", "tests"}),
    ("graphs", {"compiled_attn", "tests"}),
    ("compiled_attn", {"tests", "sglang_harness", "batch_factory", "reference"}),
]
CORE_FORBIDDEN = ("compiled_attn.sglang", "compiled_attn.bench")


def _imports(path: pathlib.Path) -> list[str]:
    """Absolute names of everything ``path`` imports (relative imports resolved against its package)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def test_imports_flow_one_way():
    bad = []
    for folder, forbidden in RULES:
        for path in (ROOT / folder).rglob("*.py"):
            for name in _imports(path):
                if name.split(".")[0] in forbidden:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    for path in (ROOT / "compiled_attn").glob("*.py"):
        bad += [f"{path.relative_to(ROOT)} imports {n}" for n in _imports(path) if n.startswith(CORE_FORBIDDEN)]
    assert not bad, "\n".join(bad)


def _from_imports(path: pathlib.Path) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of each ``from ... import`` in ``path``, and (line, module, []) of each plain
    ``import`` (relative imports resolved against its package)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((node.lineno, module, [a.name for a in node.names]))
    return found


def _public_names(module: str) -> set[str]:
    """A core module's public names: its ``__all__``, and what the package exports from it (``compiled_attn``'s
    ``_EXPORTS``: modules the package re-exports by name)."""
    import compiled_attn

    if module == "compiled_attn":
        return set(compiled_attn.__all__)
    short = module.removeprefix("compiled_attn.")
    return set(getattr(importlib.import_module(module), "__all__", ())) | set(compiled_attn._EXPORTS.get(short, ()))


def test_sglang_integration_imports_only_public_names():
    """``compiled_attn/sglang/`` imports from the core (``compiled_attn`` and its modules) only names those modules
    list as public, never a module itself (whose every name would then be reachable)."""
    bad = []
    for path in (ROOT / "compiled_attn" / "sglang").rglob("*.py"):
        for line, module, names in _from_imports(path):
            core = module == "compiled_attn" or module.startswith("compiled_attn.") and not module.startswith(
                ("compiled_attn.sglang", "compiled_attn.bench"))
            if not core:
                continue
            where = f"{path.relative_to(ROOT)}:{line}"
            if not names:
                bad.append(f"{where} imports the module {module}; import its public names")
            public = _public_names(module)
            bad += [f"{where} imports {module}.{n}, not a public name there" for n in names if n not in public]
    assert not bad, "\n".join(bad)


#: the planning side: host checks and metadata, and the block arithmetic it shares with the run code
PLANNING = ("plan", "verify_plan", "validate")


def test_planning_imports_no_run_code():
    """``plan`` (and the planning modules it builds on) import nothing from the run side (``decode``, ``verify``,
    ``extend``, the kernels): what both sides use lives on the planning side."""
    bad = []
    for name in PLANNING:
        path = ROOT / "compiled_attn" / f"{name}.py"
        for line, module, names in _from_imports(path):
            targets = [f"{module}.{n}" for n in names] if module == "compiled_attn" else [module]
            bad += [f"compiled_attn/{name}.py:{line} imports {t}" for t in targets
                    if t.startswith("compiled_attn.") and t.split(".")[1] not in PLANNING]
    assert not bad, "\n".join(bad)


def test_plugin_import_is_light():
    light = ("compiled_attn.sglang", "compiled_attn.sglang.plugin")
    code = ("import sys, compiled_attn.sglang.plugin; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang') "
            f"or m.startswith('compiled_attn.') and m not in {light!r}]; print(heavy); assert not heavy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_package_exports_resolve():
    import compiled_attn

    for name in compiled_attn.__all__:
        assert getattr(compiled_attn, name) is not None


def test_tests_change_compiler_config_through_its_own_patch():
    """A test changes dynamo's or inductor's config with ``torch._dynamo.config.patch`` /
    ``torch._inductor.config.patch``, never ``monkeypatch.setattr`` on the config module: pytest 9 undoes that with
    ``delattr`` where the key is not in the module's ``__dict__``, deleting the setting for the rest of the run."""
    bad = []
    for path in (ROOT / "tests").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                    and node.args and ast.unparse(node.args[0]).endswith(("_dynamo.config", "_inductor.config"))):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


#: the most modules the library's top level holds (its kernels, runners, integration and tooling are subpackages)
TOP_LEVEL_MODULES = 12


def test_library_top_level_is_small():
    modules = sorted(p.name for p in (ROOT / "compiled_attn").glob("*.py"))
    assert len(modules) <= TOP_LEVEL_MODULES, f"{len(modules)} modules: {modules}"


def _module_of(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` (under ``root``) it imports anywhere in its source, lazy imports in
    functions included. ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to ``pkg``;
    a name the ``compiled_attn`` package exports on first use (``_EXPORTS``) is an edge to the module it comes
    from."""
    import compiled_attn

    files = [p for pkg in packages for p in (root / pkg).rglob("*.py")]
    modules = {_module_of(p, root) for p in files}
    graph = {}
    for path in files:
        me = _module_of(path, root)
        package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                for a in node.names:
                    if f"{module}.{a.name}" in modules:
                        edges.add(f"{module}.{a.name}")
                    elif module == "compiled_attn" and a.name in compiled_attn._MODULE_OF:
                        edges.add(f"compiled_attn.{compiled_attn._MODULE_OF[a.name]}")
                    else:
                        edges.add(module)
        graph[me] = (edges & modules) - {me}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules) as a path ``[a, b, .., a]``, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = "done"
        return None

    return next((c for node in sorted(graph) if node not in state and (c := visit(node, [node]))), None)


def test_no_import_cycle_anywhere():
    """Not in the library, its kernels, runners, integration or tooling (``bench/`` included), ``graphs/`` or
    ``profiling/``."""
    graph = import_graph(ROOT, ("compiled_attn", "graphs", "profiling"))
    assert {"compiled_attn.bench.ops_decode", "compiled_attn.bench.sweep"} <= graph["compiled_attn.bench.ops"]
    assert "compiled_attn.kernels.cpu.kernel" in graph["compiled_attn.decode"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The walk sees lazy (in-function), ``from . import`` and absolute imports; the check finds their cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .b import g\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from pkg.a import f\nimport os\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}, "pkg.d": {"pkg.c"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert find_cycle({**graph, "pkg.c": set()}) is None

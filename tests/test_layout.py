"""The layout's promises: imports flow one way, the package never imports tests/, and the SGLang plugin (loaded
by SGLang in every process) imports nothing heavy."""
import ast
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

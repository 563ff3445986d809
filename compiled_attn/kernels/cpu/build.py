"""Building and loading the C++ decode kernel (``kernel`` runs it): one shared library per instruction-set level.

- ``csrc/block_partials.cpp`` (with the headers beside it): the kernel, ``-O3 -march=<level> -fopenmp``.
- ``csrc/torch_op.cpp``: the torch op that checks a call's tensors and calls the kernel, registered at load under a
  namespace of the build's own (builds for several levels live in one process). Its torch headers are slow to
  compile, so it is compiled once (no ``-march``) into a cached object that every level's build links.

Both go into a cache folder (``COMPILED_ATTN_CACHE_DIR``, default ``~/.cache/compiled_attn``) under names keyed by
the sources, the compiler, the flags, torch's version and the CPU's feature flags; a file is written under a name of
its own and renamed into place, so a process never loads half of one.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import types
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "block_partials.cpp"
#: the ops' translation unit (``csrc/torch_op.cpp``), built once and linked into every level's build
OP_SOURCE = SOURCE.parent / "torch_op.cpp"
CACHE_ENV = "COMPILED_ATTN_CACHE_DIR"
__all__ = ["CACHE_ENV", "OP_SOURCE", "SOURCE", "KernelLibrary", "build", "cache_dir", "load", "op_source"]
#: the namespaces whose ops a loaded library registered (an identical build loaded from another folder reuses them)
_REGISTERED: dict[str, types.SimpleNamespace] = {}


def cache_dir() -> Path:
    """Where built kernels are kept: ``$COMPILED_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/compiled_attn``, else
    ``~/.cache/compiled_attn``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "compiled_attn"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for code that includes torch's headers and links its libraries, as
    ``torch.utils.cpp_extension`` builds an extension: its include and library folders, torch's C++ ABI."""
    from torch.utils import cpp_extension

    includes = [arg for path in cpp_extension.include_paths() for arg in ("-isystem", path)]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    libs = cpp_extension.library_paths()
    return [*includes, abi], [*(f"-L{p}" for p in libs), *(f"-Wl,-rpath,{p}" for p in libs), "-lc10", "-ltorch_cpu"]


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _place(out_dir: Path, out: Path, suffix: str, command) -> subprocess.Popen | None:
    """Start ``command(tmp)`` writing ``tmp``, a name of its own in ``out_dir`` (renamed to ``out`` by ``_finish``);
    None where ``out`` is built already."""
    if out.exists():
        return None
    fd, tmp = tempfile.mkstemp(suffix=suffix, dir=out_dir)
    os.close(fd)
    proc = subprocess.Popen(command(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    proc.tmp, proc.out = tmp, out
    return proc


def _finish(proc: subprocess.Popen | None, what: str, cxx: str) -> None:
    """Wait for ``proc`` (from ``_place``) and move its file into place, or raise ``RuntimeError`` with the
    compiler's message; its temporary file never stays."""
    if proc is None:
        return
    try:
        err = proc.communicate()[1]
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {what}:\n{err[-2000:]}")
        os.replace(proc.tmp, proc.out)
    finally:
        if os.path.exists(proc.tmp):
            os.unlink(proc.tmp)


def _stop(proc: subprocess.Popen | None) -> None:
    """End a compile started by ``_place`` that is no longer wanted (where ``_finish`` has not), and remove its
    file."""
    if proc is not None and proc.returncode is None:
        proc.kill()
        proc.communicate()
        if os.path.exists(proc.tmp):
            os.unlink(proc.tmp)


def build(source: Path = SOURCE, out_dir: Path | None = None, *, cxx: str | None = None,
          march: str = "native") -> Path:
    """Compile ``source`` for ``march``, link it with the ops' object (``op_source(source)``, compiled first where
    the folder lacks it) and torch's libraries into a shared library in ``out_dir`` (default ``cache_dir()``) unless
    an identical build is there; returns its path. Raises ``RuntimeError`` (with the compiler's message) when it
    cannot."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    exe = shutil.which(cxx)
    if exe is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX)")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    op_flags, link_flags = _torch_flags()
    op_flags = ["-O2", "-fPIC", "-std=c++17", *op_flags]
    flags = ["-O3", f"-march={march}", "-fopenmp", "-fPIC", "-std=c++17"]
    # the headers beside the source are part of it (it includes them by name)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]
    out_dir = Path(out_dir) if out_dir is not None else cache_dir()
    op_file = op_source(source)
    op_name = f"{op_file.stem}-{_key(op_file.read_text(), *headers, exe, version, *op_flags, torch.__version__)}.o"
    # the ops' object from the default cache where a build elsewhere finds it there (it is the same for any level)
    op_obj = next((d / op_name for d in (out_dir, cache_dir()) if (d / op_name).exists()), out_dir / op_name)
    key = _key(source.read_text(), *headers, exe, version, *flags, *link_flags, op_name, _cpu_flags())
    out = out_dir / f"{source.stem}-{march}-{key}.so"
    if out.exists():
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    # the two compiles side by side (a second core hides the ops' one), then the link
    op = _place(out_dir, op_obj, ".o", lambda tmp: [exe, *op_flags, "-c", str(op_file), "-o", tmp])
    fd, kernel_obj = tempfile.mkstemp(suffix=".o", dir=out_dir)  # serves this link only
    os.close(fd)
    try:
        done = subprocess.run([exe, *flags, "-c", str(source), "-o", kernel_obj], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed on {source.name}:\n{done.stderr[-2000:]}")
        _finish(op, op_file.name, cxx)
        link = _place(out_dir, out, ".so", lambda tmp: [exe, "-shared", "-fopenmp", "-o", tmp, kernel_obj,
                                                         str(op_obj), *link_flags])
        _finish(link, f"the link of {out.name}", cxx)
    except BaseException:
        _stop(op)
        raise
    finally:
        os.unlink(kernel_obj)
    return out


def op_source(source: Path) -> Path:
    """The ops' file a build of ``source`` links: the ``torch_op.cpp`` beside it where there is one (the op and the
    kernel from one tree: they share ``kernel_call.h``'s struct, so a kernel from another checkout, as an A/B
    script builds, must not meet this package's op), else ``OP_SOURCE``."""
    beside = Path(source).parent / OP_SOURCE.name
    return beside if beside.exists() else OP_SOURCE


class KernelLibrary(ctypes.CDLL):
    """A built kernel: ``ca_isa`` through ctypes (what the build runs) and ``ops``, its torch op
    (``decode_blocks``: ``csrc/torch_op.cpp``)."""

    ops: types.SimpleNamespace


def load(path: Path) -> KernelLibrary:
    """The built library (after ``import torch``: its OpenMP and torch's libraries are the ones loaded) with its
    ops registered under the namespace its file's name gives."""
    lib = KernelLibrary(str(path))
    lib.ca_isa.restype = ctypes.c_int
    lib.ca_isa.argtypes = []
    namespace = "compiled_attn_" + re.sub(r"\W", "_", Path(path).stem)
    if namespace not in _REGISTERED:
        lib.ca_register_ops.restype, lib.ca_register_ops.argtypes = ctypes.c_int, [ctypes.c_char_p]
        if lib.ca_register_ops(namespace.encode()) != 0:
            lib.ca_register_error.restype = ctypes.c_char_p
            raise RuntimeError(f"{Path(path).name}: its ops cannot be registered as {namespace}: "
                               f"{lib.ca_register_error().decode()}")
        ops = getattr(torch.ops, namespace)
        _REGISTERED[namespace] = types.SimpleNamespace(decode_blocks=ops.decode_blocks.default)
    lib.ops = _REGISTERED[namespace]
    return lib

"""Named profiling ranges that show up in both Nsight Systems (NVTX) and torch.profiler.

``range(name, **attrs)`` is the single way to mark a region::

    from profiling import range as prange

    with prange("decode_step", bs=8):
        for layer in range(n_layers):
            with prange("attn", layer=layer, bs=8, kv_cap=2048):
                out = attn_layer(...)          # an eager call, or a graph replay

When enabled, entering a range

* pushes an NVTX range in the domain ``"compiled_attn"`` with message ``"attn layer=3 bs=8 kv_cap=2048"``
  (the name, then the attributes as ``key=value`` in the order given) and a colour chosen by the phase,
  i.e. the name's first token (``decode``, ``extend``, ``prefill``, ``warmup``, ``compile``, ``capture``,
  ``replay``, ``fallback``, ``plan``, ``attn``; ``decode_step`` -> ``decode``);
* opens a ``torch.profiler.record_function`` with the same message, so a torch.profiler trace (also on CPU)
  contains an event of that name with ``"cat": "user_annotation"``. (Skipped while no torch profiler is
  recording, since it costs several microseconds and would record nothing.)

When disabled (the default), ``range`` returns one shared no-op context manager and calls nothing else:
no NVTX call, no record_function, no allocation.

Where ranges belong
-------------------
Ranges are Python-side markers. Put them *around* calls: around CUDA-graph capture and replay, around
``torch.compile`` warm-up/compilation, around per-layer eager calls. Never put them inside a function that
``torch.compile`` traces (dynamo would either graph-break or drop them) and never rely on them inside a
captured CUDA graph: a replay does not re-run Python, so a range recorded during capture is not replayed.
To see kernels inside a replayed graph, profile with ``nsys profile --cuda-graph-trace=node``.
As a safety net, ``range`` is a no-op while ``torch.compiler.is_compiling()`` is true.

Enabling
--------
Process-wide switch: ``set_enabled(flag)`` / ``enabled()``; the default comes from the environment variable
``COMPILED_ATTN_NVTX`` (``1``/``true``/``yes``/``on`` enable it). ``enabled_ranges(flag)`` sets the switch for
a ``with`` block and restores the previous value.

Decorators: ``@ranged("plan", bs=8)`` checks the switch on every call of the decorated function, so a
function decorated at import time still gets its range when ranges are enabled later. ``@range(...)`` also
works as a decorator, but it decides at decoration time (disabled then -> the function is left unchanged).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["range", "ranged", "set_enabled", "enabled", "enabled_ranges", "format_message", "phase_of", "color_of",
           "DOMAIN"]

DOMAIN = "compiled_attn"
ENV_VAR = "COMPILED_ATTN_NVTX"

# ARGB colours per phase (ints, so the nvtx package needs no matplotlib to resolve names).
PHASE_COLORS: dict[str, int] = {
    "decode": 0xFF1F77B4,    # blue
    "extend": 0xFF17BECF,    # cyan
    "prefill": 0xFF2CA02C,   # green
    "warmup": 0xFFBCBD22,    # olive
    "compile": 0xFFFF7F0E,   # orange
    "capture": 0xFF9467BD,   # purple
    "replay": 0xFF8C564B,    # brown
    "fallback": 0xFFD62728,  # red
    "plan": 0xFFE377C2,      # pink
    "attn": 0xFF7F7F7F,      # grey
}
DEFAULT_COLOR = 0xFFAAAAAA

_TOKEN_SPLIT = re.compile(r"[\s_.:/\-]+")


def _env_default() -> bool:
    """The switch's initial value, from ``COMPILED_ATTN_NVTX``."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


class _State:
    """The process-wide on/off switch (one attribute, read on every ``range`` call)."""

    __slots__ = ("enabled",)

    def __init__(self, flag: bool) -> None:
        self.enabled = flag


_STATE = _State(_env_default())


def set_enabled(flag: bool) -> None:
    """Turn ranges on or off for the whole process."""
    _STATE.enabled = bool(flag)


def enabled() -> bool:
    """Whether ``range`` currently emits NVTX ranges and record_function events."""
    return _STATE.enabled


@contextlib.contextmanager
def enabled_ranges(flag: bool = True) -> Iterator[None]:
    """Set the switch to ``flag`` inside the block and restore the previous value afterwards."""
    previous = _STATE.enabled
    _STATE.enabled = bool(flag)
    try:
        yield
    finally:
        _STATE.enabled = previous


def phase_of(name: str) -> str:
    """The phase of a range name: its first token (``"decode_step bs=2"`` -> ``"decode"``)."""
    head = _TOKEN_SPLIT.split(name.strip(), maxsplit=1)[0]
    return head.lower()


def format_message(name: str, attrs: dict[str, Any]) -> str:
    """``name`` followed by ``key=value`` for each attribute, in the order given."""
    if not attrs:
        return name
    return " ".join([name] + [f"{k}={v}" for k, v in attrs.items()])


_COLOR_CACHE: dict[str, int] = {}


def color_of(name: str) -> int:
    """The ARGB colour of a range name, by its phase (cached per name)."""
    color = _COLOR_CACHE.get(name)
    if color is None:
        color = _COLOR_CACHE[name] = PHASE_COLORS.get(phase_of(name), DEFAULT_COLOR)
    return color


def _torch_profiler_active() -> bool:
    """Whether a torch (autograd/kineto) profiler is recording; record_function is skipped otherwise."""
    return _PROFILER_ENABLED()


_PROFILER_ENABLED: Callable[[], bool] = getattr(
    getattr(torch._C, "_autograd", None), "_profiler_enabled", lambda: True)


# ---- NVTX push/pop: the only two places that call the nvtx package (tests monkeypatch these) ----

_NVTX_DOMAIN: list = []  # filled on first use: [nvtx Domain or DummyDomain]


def _domain():
    """The ``compiled_attn`` NVTX domain (a dummy when no tool such as nsys is attached), created once."""
    if not _NVTX_DOMAIN:
        import nvtx

        _NVTX_DOMAIN.append(nvtx.get_domain(DOMAIN))
    return _NVTX_DOMAIN[0]


@functools.lru_cache(maxsize=4096)
def _attributes(message: str, color: int):
    """Cached NVTX event attributes (registering the message string once)."""
    return _domain().get_event_attributes(message=message, color=color)


def nvtx_push(message: str, color: int) -> None:
    """Push an NVTX range in the ``compiled_attn`` domain on this thread."""
    _domain().push_range(_attributes(message, color))


def nvtx_pop() -> None:
    """Pop the innermost NVTX range of the ``compiled_attn`` domain on this thread."""
    _domain().pop_range()


# ---- context managers ----

class _NoopRange:
    """The shared do-nothing range returned while ranges are disabled (or while torch.compile traces)."""

    __slots__ = ()

    def __enter__(self) -> _NoopRange:
        return self

    def __exit__(self, *exc: object) -> bool:
        return False

    def __call__(self, fn: Callable) -> Callable:
        """Decorating while disabled leaves ``fn`` unchanged (use ``ranged`` for a per-call check)."""
        return fn


_NOOP = _NoopRange()


class _Range:
    """An active range: NVTX push + record_function on enter, the reverse on exit.

    One object per ``range(...)`` call; do not enter the same object twice at once.
    """

    __slots__ = ("name", "attrs", "message", "color", "_rf")

    def __init__(self, name: str, attrs: dict[str, Any]) -> None:
        self.name = name
        self.attrs = attrs
        self.message = format_message(name, attrs)
        self.color = color_of(name)
        self._rf = None

    def __enter__(self) -> _Range:
        nvtx_push(self.message, self.color)
        if _torch_profiler_active():
            try:
                rf = torch.profiler.record_function(self.message)
                rf.__enter__()
            except BaseException:
                nvtx_pop()
                raise
            self._rf = rf
        return self

    def __exit__(self, *exc: object) -> bool:
        rf, self._rf = self._rf, None
        try:
            if rf is not None:
                rf.__exit__(*exc)
        finally:
            nvtx_pop()
        return False

    def __call__(self, fn: Callable) -> Callable:
        """Decorator form: every call of ``fn`` runs inside this range (switch checked per call)."""
        return ranged(self.name, **self.attrs)(fn)


def range(name: str, **attrs: Any):
    """A named profiling range: ``with range("attn", layer=3, bs=8): ...``.

    ``name``'s first token picks the NVTX colour; ``attrs`` are appended to the message as ``key=value``.
    Disabled (the default) or under ``torch.compiler.is_compiling()``: returns one shared no-op and calls
    nothing else. Also usable as a decorator; note that a decorator is evaluated once, at decoration time, so
    ``@range(...)`` applied while ranges are disabled leaves the function undecorated -- for functions
    decorated at import time use ``@ranged(...)``, which checks the switch on every call.
    See the module docstring for where ranges belong (around capture/replay/eager calls, never inside code
    that torch.compile traces).
    """
    if not _STATE.enabled or torch.compiler.is_compiling():
        return _NOOP
    return _Range(name, attrs)


def ranged(name: str, **attrs: Any) -> Callable[[Callable], Callable]:
    """Decorator: run each call of the function inside ``range(name, **attrs)``, checking the switch per call."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _STATE.enabled:
                return fn(*args, **kwargs)
            with range(name, **attrs):
                return fn(*args, **kwargs)

        return wrapper

    return decorate

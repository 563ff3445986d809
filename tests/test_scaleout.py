"""Scale-out on CPU without a live engine: every process SGLang starts gets the CPU fix-ups, and each rank its CPUs.

- What SGLang 0.5.23's launcher starts by its own names (the data-parallel controller, attention DP's pre-started
  schedulers) is read from its source (no import) and must be what ``cpu_fixups.LAUNCHER_TARGETS`` wraps; the
  controller itself starts schedulers only through the target it is handed.
- The chain launcher -> controller -> scheduler is run with spawned processes as SGLang runs it (targets pickled
  by name, arguments after them), with stand-in functions for SGLang's: in each child the fix-ups are in place
  before the arguments (which import SGLang in a real run) are unpickled.
- ``serve``'s per-rank ``SGLANG_CPU_OMP_THREADS_BIND`` (how the CPUs are split, the one log line, a layout this
  machine can't run refused with a line naming the flags) and the refusal of ``--enable-torch-compile`` with DP
  attention (SGLang's CPU graph runner cannot run it).

The live runs (tensor parallel 2, DP attention, against transformers) are in ``test_live_scaleout.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import sys
import types

import pytest

from compiled_attn.sglang import cpu_fixups, serve

# --- SGLang's launcher, read from its source -------------------------------------------------------------------


def _sglang_source(module: str) -> ast.Module:
    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("SGLang is not installed")
    path = os.path.join(spec.submodule_search_locations[0], *module.split(".")[1:]) + ".py"
    with open(path) as f:
        return ast.parse(f.read())


def _process_targets(tree: ast.Module) -> list[ast.expr]:
    """The ``target=`` of every ``...Process(...)`` call, and every value assigned to a variable named ``target``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Process":
            out += [kw.value for kw in node.keywords if kw.arg == "target"]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "target" for t in node.targets):
            out.append(node.value)
    return out


def _parameters(tree: ast.Module) -> set[str]:
    return {a.arg for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for a in node.args.args + node.args.kwonlyargs}


def _imports(tree: ast.Module) -> dict[str, str]:
    """name -> module, for the module-level ``from module import name`` of ``tree``."""
    return {alias.asname or alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}


def test_the_launcher_starts_by_its_own_names_only_what_the_fixups_wrap():
    """engine.py's process targets are the engine's replaceable ones (parameters: ``run_scheduler_process_func``,
    ``run_detokenizer_process_func``, ours), a variable, or a name of its own: each such name must be in
    ``LAUNCHER_TARGETS``, imported from the module listed there. GPU-only helpers (weight cache, elastic EP) start
    elsewhere; a new SGLang target fails here instead of in a live run."""
    tree = _sglang_source(cpu_fixups.LAUNCHER)
    params, imported = _parameters(tree), _imports(tree)
    names = {t.id for t in _process_targets(tree) if isinstance(t, ast.Name)} - params - {"target"}
    wrapped = dict(cpu_fixups.LAUNCHER_TARGETS)
    assert names <= set(wrapped), f"launched by name and not wrapped: {names - set(wrapped)}"
    assert {"run_data_parallel_controller_process", "run_scheduler_process_with_init_pipe"} <= names
    for name, module in wrapped.items():
        assert imported.get(name) == module, (name, imported.get(name))
        defined = {n.name for n in _sglang_source(module).body if isinstance(n, ast.FunctionDef)}
        assert name in defined, (module, name)


def test_the_controller_starts_schedulers_with_the_target_it_is_handed():
    tree = _sglang_source("sglang.srt.managers.data_parallel_controller")
    targets = [ast.unparse(t) for t in _process_targets(tree)]
    assert targets == ["self.run_scheduler_process_func"], targets


# --- the chain launcher -> controller -> schedulers, spawned -----------------------------------------------------
# Stand-ins for SGLang's functions, with SGLang's signatures; each child records what the fix-ups had done when its
# arguments were unpickled (a _Probe's unpickling) into $COMPILED_ATTN_TEST_OUT. Processes are spawned, as SGLang's
# are (engine.py sets the start method "spawn"): a forked child would inherit the parent's fix-ups.
_spawn = mp.get_context("spawn")


def _record(label: str) -> str:
    with open(os.path.join(os.environ["COMPILED_ATTN_TEST_OUT"], f"{label}.json"), "w") as f:
        json.dump(dict(applied=sorted(cpu_fixups.APPLIED), sglang_imported="sglang" in sys.modules), f)
    return label


class _Probe:
    """An argument whose unpickling records the child's fix-ups (SGLang's ServerArgs imports SGLang there)."""

    def __init__(self, label: str):
        self.label = label

    def __reduce__(self):
        return _record, (self.label,)


def run_data_parallel_controller_process(server_args, port_args, pipe_writer, run_scheduler_process_func,
                                         prelaunched_schedulers=None):
    """SGLang's controller, reduced to how it starts a scheduler (data_parallel_controller.py:790)."""
    proc = _spawn.Process(target=run_scheduler_process_func, args=(_Probe("scheduler_from_controller"),))
    proc.start()
    proc.join()


def run_scheduler_process_with_init_pipe(run_scheduler_process_func, pipe):
    """SGLang's pre-started DP-attention scheduler: its arguments come through the pipe, later."""
    scheduler_args = pipe.recv()
    run_scheduler_process_func(*scheduler_args)


def run_scheduler_process(*args):
    """SGLang's scheduler (its arguments are unpickled by now)."""


def run_multi_detokenizer_router_process(*args):
    """SGLang's detokenizer router (``--detokenizer-worker-num > 1``)."""


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """A stand-in for SGLang's launcher module with this module's functions, wrapped as the fix-up wraps SGLang's."""
    if not cpu_fixups.cpu_only() or cpu_fixups.sglang_version() is None:
        pytest.skip("the fix-ups apply on a CPU-only machine with SGLang installed")
    if cpu_fixups.sglang_version() > cpu_fixups.SGLANG_0_5_23:
        pytest.skip("the fix-ups are for SGLang <= 0.5.23")
    module = types.ModuleType(cpu_fixups.LAUNCHER)
    for name, _ in cpu_fixups.LAUNCHER_TARGETS:
        setattr(module, name, globals()[name])
    monkeypatch.setitem(sys.modules, cpu_fixups.LAUNCHER, module)
    monkeypatch.setattr(cpu_fixups, "LAUNCHER_TARGETS", tuple((n, __name__) for n, _ in cpu_fixups.LAUNCHER_TARGETS))
    monkeypatch.setenv("COMPILED_ATTN_TEST_OUT", str(tmp_path))
    return module


def _read(tmp_path, label: str) -> dict:
    with open(tmp_path / f"{label}.json") as f:
        return json.load(f)


def test_wrapped_launcher_targets_are_child_targets(launcher):
    assert cpu_fixups.wrap_launcher_targets() is True
    for name, module in cpu_fixups.LAUNCHER_TARGETS:
        assert getattr(launcher, name) == cpu_fixups.ChildTarget(module, name)
    assert cpu_fixups.wrap_launcher_targets() is False  # once
    del sys.modules[cpu_fixups.LAUNCHER]
    assert cpu_fixups.wrap_launcher_targets() is None  # no launcher here: nothing to wrap, tried again later


BEFORE_SGLANG = {"torchvision", "cpu_engine_env", "sgl_kernel_stand_in"}


def test_controller_and_its_schedulers_get_the_fixups_first(launcher, tmp_path):
    """engine.py:974-975: the controller's process, then the scheduler it starts with the scheduler target it was
    handed (ours): in both, the fix-ups ran before the arguments were unpickled."""
    cpu_fixups.wrap_launcher_targets()
    scheduler = cpu_fixups.ChildTarget(__name__, "run_scheduler_process")  # as serve hands SGLang its own
    proc = _spawn.Process(target=launcher.run_data_parallel_controller_process,
                      kwargs=dict(server_args=_Probe("controller"), port_args=None, pipe_writer=None,
                                  run_scheduler_process_func=scheduler))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    for label in ("controller", "scheduler_from_controller"):
        assert BEFORE_SGLANG <= set(_read(tmp_path, label)["applied"]), label


def test_prestarted_dp_attention_schedulers_get_the_fixups_first(launcher, tmp_path):
    """engine.py:943, 956: with attention DP each scheduler starts before the controller, as
    ``run_scheduler_process_with_init_pipe(run_scheduler_process_func, pipe)``; its arguments arrive later."""
    cpu_fixups.wrap_launcher_targets()
    scheduler = cpu_fixups.ChildTarget(__name__, "run_scheduler_process")
    reader, writer = _spawn.Pipe(duplex=True)
    proc = _spawn.Process(target=launcher.run_scheduler_process_with_init_pipe, args=(scheduler, writer))
    proc.start()
    reader.send((_Probe("prestarted_scheduler"),))
    proc.join(120)
    assert proc.exitcode == 0
    assert BEFORE_SGLANG <= set(_read(tmp_path, "prestarted_scheduler")["applied"])


def test_without_the_wrapper_the_child_unpickles_before_any_fixup(launcher, tmp_path):
    """The control: a plain function as target (as SGLang's own are) leaves the child bare when its arguments
    unpickle, which in a real run is ``torchvision::nms does not exist``."""
    proc = _spawn.Process(target=run_scheduler_process, args=(_Probe("bare"),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    assert _read(tmp_path, "bare")["applied"] == []


# --- per-rank CPUs ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes, ranks", [
    (dict(tp_size=2), 2),
    (dict(tp_size=2, dp_size=2), 4),  # replicas: one process per rank of each
    (dict(tp_size=2, dp_size=2, enable_dp_attention=True), 2),  # attention DP splits the TP group
    (dict(tp_size=2, pp_size=2), 4),
    (dict(tp_size=4, nnodes=2), 2),
    (dict(), 1),
])
def test_scheduler_ranks(sizes, ranks):
    assert serve.scheduler_ranks(**sizes) == ranks


@pytest.mark.parametrize("ranks, cpus, expected", [
    (2, [0, 1], "0|1"),
    (2, range(16), "0-7|8-15"),
    (4, range(16), "0-3|4-7|8-11|12-15"),
    (3, range(8), "0-2|3-5|6-7"),  # sizes differ by at most one
    (2, [0, 2, 4, 6], "0,2|4,6"),
    (1, [3, 4], "3-4"),
])
def test_split_cpus_one_node(ranks, cpus, expected):
    assert serve.split_cpus(ranks, cpus, nodes=[list(range(64))]) == expected


def test_split_cpus_keeps_each_rank_on_one_numa_node():
    nodes = [list(range(0, 16)) + list(range(32, 48)), list(range(16, 32)) + list(range(48, 64))]
    assert serve.split_cpus(2, range(64), nodes) == "0-15,32-47|16-31,48-63"
    assert serve.split_cpus(4, range(64), nodes) == "0-15|32-47|16-31|48-63"
    assert serve.split_cpus(3, range(64), nodes) == "0-21|22-42|43-63"  # ranks don't divide among the nodes
    assert serve.split_cpus(2, [0, 1, 16, 17], nodes) == "0-1|16-17"  # only the CPUs this process may use


def test_split_cpus_refuses_more_ranks_than_cpus():
    with pytest.raises(ValueError, match="3 ranks need 3 CPUs, this process may run on 2"):
        serve.split_cpus(3, [0, 1])


def test_split_cpus_defaults_to_this_process_affinity():
    value = serve.split_cpus(1)
    assert sorted(cpu_fixups.parse_cpu_list(value)) == sorted(os.sched_getaffinity(0))


def _pinned_state(cpus: list[int]) -> tuple:
    """In a child: pin as a rank's scheduler is pinned, then report every thread's CPUs and torch's thread count."""
    import threading

    import torch

    started = threading.Event()
    t = threading.Thread(target=started.wait)  # a thread that exists before the pinning
    t.start()
    cpu_fixups._pin_process(cpus)
    tasks = {tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")}
    started.set()
    t.join()
    return tasks, torch.get_num_threads()


def test_pin_process_moves_every_thread_and_sizes_the_pool():
    """What ``pin_rank_threads`` does in a rank's scheduler with its ``SGLANG_CPU_OMP_THREADS_BIND`` entry (the live
    runs check the schedulers' CPUs): here in a spawned child, pinned to this process's first CPU."""
    first = min(os.sched_getaffinity(0))
    with _spawn.Pool(1) as pool:
        tasks, threads = pool.apply(_pinned_state, ([first],))
    assert tasks == {(first,)} and threads == 1


def test_parse_cpu_list():
    assert cpu_fixups.parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert cpu_fixups.parse_cpu_list("5") == [5]


@pytest.fixture
def log_lines(caplog):
    caplog.set_level(logging.INFO, logger=serve.__name__)
    return lambda: [r.getMessage() for r in caplog.records if r.name == serve.__name__]


def test_binding_set_when_none_given_with_one_log_line(log_lines):
    env: dict = {}
    value = serve.cpu_thread_binding(tp_size=2, cpus=[0, 1], nodes=[[0, 1]], environ=env)
    assert value == env[serve.OMP_BIND_ENV] == "0|1"
    lines = log_lines()
    assert len(lines) == 1 and "SGLANG_CPU_OMP_THREADS_BIND=0|1" in lines[0] and "--max-total-tokens" in lines[0]
    env = {}
    serve.cpu_thread_binding(tp_size=2, dp_size=2, enable_dp_attention=True, max_total_tokens=4096,
                             cpus=range(16), nodes=[list(range(16))], environ=env)
    assert env[serve.OMP_BIND_ENV] == "0-7|8-15" and "--max-total-tokens" not in log_lines()[-1]


def test_binding_left_to_the_user_and_to_single_rank_layouts(log_lines):
    env = {serve.OMP_BIND_ENV: "0|0"}
    assert serve.cpu_thread_binding(tp_size=2, cpus=[0, 1], environ=env) is None
    assert env == {serve.OMP_BIND_ENV: "0|0"}
    env = {}
    assert serve.cpu_thread_binding(tp_size=1, dp_size=1, cpus=[0, 1], environ=env) is None
    assert serve.cpu_thread_binding(tp_size=1, dp_size=4, enable_dp_attention=True, cpus=[0], environ=env) is None
    assert env == {} and log_lines() == []


def test_binding_of_an_earlier_engine_is_replaced(monkeypatch):
    monkeypatch.setenv(serve.OMP_BIND_ENV, "unset afterwards")  # restored (removed) after the test
    monkeypatch.delenv(serve.OMP_BIND_ENV)
    monkeypatch.setattr(serve, "_BINDING_SET", [])
    serve.cpu_thread_binding(tp_size=2, cpus=[0, 1, 2, 3], nodes=[[0, 1, 2, 3]], announce=False)
    assert os.environ[serve.OMP_BIND_ENV] == "0-1|2-3"
    serve.cpu_thread_binding(tp_size=4, cpus=[0, 1, 2, 3], nodes=[[0, 1, 2, 3]], announce=False)
    assert os.environ[serve.OMP_BIND_ENV] == "0|1|2|3"
    serve.cpu_thread_binding(tp_size=1, cpus=[0, 1, 2, 3], announce=False)
    assert serve.OMP_BIND_ENV not in os.environ  # a one-rank engine must not inherit rank 0's CPUs


@pytest.mark.parametrize("sizes, flags", [
    (dict(tp_size=4), "--tp-size 4:"),
    (dict(tp_size=2, dp_size=2), "--tp-size 2 --dp-size 2:"),
    (dict(tp_size=4, dp_size=2, enable_dp_attention=True), "--tp-size 4 --dp-size 2 --enable-dp-attention:"),
])
def test_layout_with_more_ranks_than_cpus_refused(sizes, flags):
    with pytest.raises(serve.UnsupportedArgument) as e:
        serve.cpu_thread_binding(**sizes, cpus=[0, 1], environ={})
    assert str(e.value).startswith(flags) and "\n" not in str(e.value), e.value


def test_serve_refuses_a_layout_this_machine_cannot_run(capsys):
    """Before SGLang is imported, with one line naming the flags."""
    too_many = len(os.sched_getaffinity(0)) + 1
    if not cpu_fixups.cpu_only():
        pytest.skip("the per-rank CPUs are for a CPU-only machine")
    assert serve.main(["--model-path", "unused", "--tp-size", str(too_many)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"compiled-attn serve: --tp-size {too_many}:"), err
    with pytest.raises(serve.UnsupportedArgument, match=f"^--tp-size {too_many}:"):
        serve.engine(model_path="unused", tp_size=too_many)


# --- DP attention runs eagerly on CPU -------------------------------------------------------------------------------


def test_torch_compile_with_dp_attention_refused_on_cpu(capsys):
    """SGLang 0.5.23's CPUGraphRunner asserts ``not require_mlp_tp_gather``, true for every CPU DP-attention
    layout (it needs a DeepEP-style all-to-all MoE backend to be false)."""
    with pytest.raises(serve.UnsupportedArgument, match="^--enable-torch-compile: .*DP attention"):
        serve.check_args(dp_size=2, enable_dp_attention=True, enable_torch_compile=True, cpu=True)
    with pytest.raises(serve.UnsupportedArgument, match="^--enable-torch-compile: "):
        serve.check_args(attn_dp_size=2, enable_torch_compile=True, cpu=True)
    serve.check_args(dp_size=2, enable_dp_attention=True, cpu=True)  # eager
    serve.check_args(dp_size=2, enable_torch_compile=True, cpu=True)  # replicas: no attention DP
    serve.check_args(dp_size=1, enable_dp_attention=True, enable_torch_compile=True, cpu=True)  # width 1: off
    serve.check_args(dp_size=2, enable_dp_attention=True, enable_torch_compile=True, cpu=False)  # CUDA graphs
    if cpu_fixups.cpu_only():
        argv = ["--model-path", "unused", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention",
                "--enable-torch-compile"]
        assert serve.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--enable-torch-compile" in err[0], err
        with pytest.raises(serve.UnsupportedArgument, match="^--enable-torch-compile"):
            serve.engine(model_path="unused", tp_size=2, dp_size=2, enable_dp_attention=True,
                         enable_torch_compile=True)

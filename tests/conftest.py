# Before anything imports sglang: on a CPU torch, torchvision (which SGLang imports) needs its op schemas declared
# first. The fix-up does not import sglang.
import pytest
import torch

from compiled_attn.sglang.cpu_fixups import ensure_torchvision_importable

ensure_torchvision_importable()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs CUDA (run through profiling/gpu_check.sh on a GPU machine)")
    if not torch.cuda.is_available():
        for item in items:
            # the marker itself, not the keyword "cuda": a parametrisation id such as [cuda] is a keyword too
            if item.get_closest_marker("cuda") is not None:
                item.add_marker(skip)


@pytest.fixture
def one_thread():
    """One intra-op thread: a parallel region cannot stall on a second thread that a neighbour's job has
    descheduled (the machines are shared 2-core ones); used by the timing-sensitive model and bench tests."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

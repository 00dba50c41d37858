"""Session-wide test set-up."""

import os

import torch

# Triton decides between compiling and interpreting when a kernel is decorated, i.e. at import.
# Without a GPU its kernels can only run interpreted, so ask for that before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from dist_utils import forkserver_context  # noqa: E402

forkserver_context()  # whoever starts the forkserver first, its workers start with torch imported


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matrices: several threads on a shared 2-core machine only slow them down (OpenMP
    barrier waits), and one thread fixes the summation order. Use with
    `pytestmark = pytest.mark.usefixtures("one_thread")`; module-scoped fixtures may ask for it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cpp_kernels():
    """Skip the module where moetron's C++ kernels cannot be built (no compiler or ninja)."""
    from moetron.kernels import cpp_build

    ok, reason = cpp_build.cpp_status(build=True)
    if not ok:
        pytest.skip(f"moetron's C++ kernels cannot be built here: {reason}")


@pytest.fixture(autouse=True)
def eager_fusion_after_each_test():
    """`build_run` sets the process-wide fusion mode (`train.fusion=auto` takes the C++ kernels on
    a CPU) and permute kernel; each test starts from the library's defaults (the eager reference,
    the by-device permute)."""
    from moetron.dispatch import permute

    impl = permute._default_impl
    yield
    from moetron.ops import set_fusion

    set_fusion("none")
    permute._default_impl = impl

"""Start-up and thread choices of a one-process CPU run: the cached C++ library loads without
`torch.utils.cpp_extension` (and only a copy built from these very inputs, owned by this user), and
a small model trains on one intra-op thread, a larger one keeps freed memory for reuse."""

import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from moetron.kernels import cpp_build
from moetron.kernels.threads import set_wide_threads, wide_threads
from moetron.train import host


def _require_cpp():
    ok, reason = cpp_build.cpp_status(build=True)
    if not ok:
        if reason.startswith(("no C++ compiler", "ninja is not installed")):
            pytest.skip(reason)
        pytest.fail(f"the C++ kernels failed to build: {reason}")


def test_a_fresh_process_loads_the_cached_build_without_cpp_extension():
    _require_cpp()  # built (or loaded) here first: its input-hashed copy exists now
    if not cpp_build._built_copy(cpp_build.build_directory()).is_file():
        pytest.skip("the build cache is read-only: no input-hashed copy could be kept")
    code = """
import sys
import torch
from moetron.kernels import cpp_build
ops = cpp_build.load_grouped_gemm_ops()
x, w = torch.randn(7, 5, dtype=torch.float64), torch.randn(2, 3, 5, dtype=torch.float64)
got = ops.grouped_mm(x, w, torch.tensor([4, 7], dtype=torch.int32), 0)
want = torch.cat([x[:4] @ w[0].T, x[4:] @ w[1].T])
print(cpp_build.cpp_status()[1], "torch.utils.cpp_extension" in sys.modules, torch.allclose(got, want, atol=1e-12))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].endswith("False True"), out.stdout[-500:]


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)  # record, never load a second copy
    directory = cpp_build.build_directory()
    directory.mkdir(parents=True)
    return directory, loaded, monkeypatch


def test_only_a_copy_of_these_inputs_owned_by_this_user_is_loaded(fresh_cache, tmp_path):
    directory, loaded, monkeypatch = fresh_cache
    assert not cpp_build._load_built_copy() and loaded == []  # nothing cached yet
    (directory / f"{cpp_build.EXTENSION_NAME}.so").write_bytes(b"a library")
    cpp_build._keep_built_copy(directory, cpp_build._built_copy(directory))
    copy = cpp_build._built_copy(directory)
    assert copy.read_bytes() == b"a library" and copy.name != f"{cpp_build.EXTENSION_NAME}.so"
    assert cpp_build._load_built_copy() and loaded == [str(copy)]
    os.chmod(copy, 0o777)  # others could replace its code
    assert not cpp_build._load_built_copy() and len(loaded) == 1
    os.chmod(copy, 0o755)
    changed = tmp_path / "permute_cpu.cpp"
    changed.write_text(cpp_build.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(cpp_build, "SOURCE", changed)  # other sources: another name, not built yet
    assert cpp_build._built_copy(directory) != copy and not cpp_build._load_built_copy() and len(loaded) == 1


def _run(device="cpu", world_size=1):
    return SimpleNamespace(device=torch.device(device), ps=SimpleNamespace(world_size=world_size))


def _sized(seq_len, hidden):
    return SimpleNamespace(train=SimpleNamespace(micro_batch_size=8, seq_len=seq_len),
                           model=SimpleNamespace(hidden_size=hidden))


@pytest.mark.parametrize("seq_len,hidden,env,device,world,want", [
    (128, 64, None, "cpu", 1, 1),      # the default recipe: one thread
    (32, 512, None, "cpu", 1, 1),      # 131,072 elements per op: one thread
    (64, 512, None, "cpu", 1, 2),      # 262,144: two (the mid-size proxy has 524,288)
    (512, 512, None, "cpu", 1, 2),     # a mid-size proxy: the threads torch chose
    (128, 64, "2", "cpu", 1, 2),       # OMP_NUM_THREADS decides
    (128, 64, None, "cpu", 2, 2),      # ranks of a torchrun: left alone
    (128, 64, None, "meta", 1, 2),     # not a CPU run
])
def test_small_models_train_on_one_intra_op_thread(monkeypatch, seq_len, hidden, env, device, world, want):
    threads = torch.get_num_threads()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # the load plays no part
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    lines = []
    try:
        torch.set_num_threads(2)
        host.small_model_threads(_run(device, world), _sized(seq_len, hidden), lines.append)
        assert torch.get_num_threads() == want
        assert wide_threads() == (2 if want < 2 else 1)  # the experts' GEMMs keep both threads
        assert bool(lines) == (want < 2) and all("activation elements per op" in line for line in lines)
    finally:
        torch.set_num_threads(threads)
        set_wide_threads(1)


_FAULTS = """
import resource
import torch
from moetron.kernels.threads import set_wide_threads, wide_threads
from moetron.train import host
lines = []
print(host.keep_freed_memory(torch.device(DEVICE), lines.append), len(lines))
faults = []
for _ in range(24):  # a step's pattern, repeated: a 64 MiB tensor (over glibc's largest mmap threshold)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20).uniform_()
    assert float(x.sum()) != 0
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[-6:]), len(faults))
"""


@pytest.mark.parametrize("device,env,kept", [("cpu", None, True), ("meta", None, False),
                                             ("cpu", ("MALLOC_MMAP_MAX_", "65536"), False),
                                             ("cpu", ("MALLOC_ARENA_MAX", "2"), False)])
def test_a_cpu_run_reuses_freed_memory_instead_of_page_faulting(device, env, kept):
    """A 64 MiB tensor allocated again after a free page-faults in all its 16k pages every time unless
    the setting is made; with it, once the heap has settled (torch's 64-byte aligned blocks leave the
    first few freed blocks a little too small: ~8 rounds here), no page faults again. A run off the
    CPU, or a MALLOC_* variable of the user's, leaves glibc as it is."""
    import platform
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the setting is glibc's")
    environ = {k: v for k, v in os.environ.items() if not host.user_chose_allocator({k: v})}
    environ["OMP_NUM_THREADS"] = "1"
    if env is not None:
        environ[env[0]] = env[1]
    out = subprocess.run([sys.executable, "-c", _FAULTS.replace("DEVICE", repr(device))], capture_output=True,
                         text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (made, logged), (faults, rounds) = (line.split() for line in out.stdout.split("\n")[:2])
    assert (made, logged, rounds) == (str(kept), str(int(kept)), "24"), out.stdout
    pages = 6 * (64 << 20) // resource.getpagesize()  # the last six rounds
    assert (int(faults) < pages // 16) if kept else (int(faults) > pages // 2), (faults, pages)


_LAUNCH = """
import os, sys
import moetron
print("torch" in sys.modules)  # the package itself loads torch only on first use of MoELayer / MoEConfig
from moetron import MoEConfig
from moetron.__main__ import main
sys.argv = ["moetron", "recipes"]
code = main()
print(code, os.environ.get("OMP_WAIT_POLICY"), MoEConfig.__name__)
"""


@pytest.mark.parametrize("env,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_command_line_sets_openmp_waiting_to_sleep_before_torch_loads(env, want):
    """The policy is read when torch loads libgomp: `import moetron` must not load torch, and the
    command line sets PASSIVE unless the user chose a policy."""
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if env is not None:
        environ["OMP_WAIT_POLICY"] = env
    out = subprocess.run([sys.executable, "-c", _LAUNCH], capture_output=True, text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "False" and lines[-1] == f"0 {want} MoEConfig", out.stdout[-1000:]


_GC = """
import gc, sys
from moetron.__main__ import main
during_import = []
gc.callbacks.append(lambda phase, info: phase == "start" and during_import.append("moetron.cli" not in sys.modules))
sys.argv = ["moetron", "recipes"]
code = main()
print(code, sum(during_import), gc.isenabled(), gc.get_freeze_count() > 100_000)
"""


def test_the_command_line_imports_without_collecting_and_freezes_what_it_imported():
    """No collection while torch and moetron import (each walked their objects), and the imported
    objects frozen out of later collections (the one at exit took ~0.7 s); collection is on after."""
    out = subprocess.run([sys.executable, "-c", _GC], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "0 0 True True", out.stdout[-1000:]

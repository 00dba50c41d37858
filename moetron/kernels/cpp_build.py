"""Build and load moetron's CPU kernels (`moetron/csrc/permute_cpu.cpp`, `swiglu_cpu.cpp`,
`grouped_gemm_cpu.cpp`, `rmsnorm_rope_cpu.cpp`, `router_cpu.cpp`, `causal_attention_cpu.cpp`,
`cross_entropy_cpu.cpp`: one library, compiled as two units, `base_kernels.cpp` and `fma_kernels.cpp`)
on first use, once per machine.

`torch.utils.cpp_extension.load` compiles the units with ninja into
`$TORCH_EXTENSIONS_DIR/moetron_permute_cpu-torch<version>-py<ver>/` (default
`~/.cache/torch_extensions/...`) and rebuilds only when a source or the flags change; the first
build takes about 45 s of CPU (~25 s wall on two cores). Concurrent first builds wait on torch's lock file
in that folder.
A finished build is also copied there under a name that hashes its inputs (sources, flags, torch and
Python versions): a later process that finds that file loads it directly, without importing
`torch.utils.cpp_extension` or running ninja (about 0.3 s of every start-up); the copy is written
once and renamed into place, so a concurrent rebuild from other sources never changes it.
Building needs a C++ compiler (`$CXX` or `c++`) and `ninja`;
when either is missing, or the build fails, `load_permute_ops()` raises `CppBuildError`
with a one-line reason and the caller decides (an explicit `impl="cpp"` is an error,
`impl="auto"` falls back to the torch reference with a one-line notice).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXTENSION_NAME = "moetron_permute_cpu"
SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "permute_cpu.cpp"
SWIGLU_SOURCE = SOURCE.with_name("swiglu_cpu.cpp")  # built with SOURCE: one library, one build
GEMM_SOURCE = SOURCE.with_name("grouped_gemm_cpu.cpp")  # likewise
NORM_SOURCE = SOURCE.with_name("rmsnorm_rope_cpu.cpp")  # likewise
ROUTER_SOURCE = SOURCE.with_name("router_cpu.cpp")  # likewise
ATTENTION_SOURCE = SOURCE.with_name("causal_attention_cpu.cpp")  # likewise
CE_SOURCE = SOURCE.with_name("cross_entropy_cpu.cpp")  # likewise
# The two translation units compiled: each includes several of the files above (torch's headers cost every
# unit ~10 s of CPU; see base_kernels.cpp)
BASE_UNIT = SOURCE.with_name("base_kernels.cpp")  # SOURCE, NORM_SOURCE, ROUTER_SOURCE and GEMM_SOURCE
FMA_UNIT = SOURCE.with_name("fma_kernels.cpp")  # SWIGLU_SOURCE, ATTENTION_SOURCE and CE_SOURCE
SIMD_HEADER, TASKS_HEADER = SOURCE.with_name("simd_math.h"), SOURCE.with_name("helper_tasks.h")
# -ffp-contract=off: no FMA contraction, the fused numerics equal the torch reference bit for bit.
CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]
LDFLAGS = ["-fopenmp"]


class CppBuildError(RuntimeError):
    """The C++ permute kernel cannot be built or loaded here; the message is one line."""


_lock = threading.Lock()
_result: tuple[bool, str] | None = None  # (ok, reason or library path), cached for the process
_build_seconds: float | None = None


def _missing_tool() -> str | None:
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler: '{cxx}' is not on PATH (install g++ or set CXX)"
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:  # pragma: no cover - every supported torch has it
        return "torch.utils.cpp_extension is unavailable"
    if not is_ninja_available():
        return "ninja is not installed (pip install ninja)"
    for source in _inputs():
        if not source.is_file():
            return f"source {source} not found (moetron installed without csrc/)"
    return None


def _sources() -> tuple[Path, ...]:
    """The translation units the build compiles."""
    return BASE_UNIT, FMA_UNIT


def _inputs() -> tuple[Path, ...]:
    """Every file the build reads: the units and the files they include."""
    return _sources() + (SOURCE, NORM_SOURCE, ROUTER_SOURCE, GEMM_SOURCE, SWIGLU_SOURCE, ATTENTION_SOURCE, CE_SOURCE,
                         SIMD_HEADER, TASKS_HEADER)


def build_directory(name: str = EXTENSION_NAME) -> Path:
    """Per torch version and Python: a library built against one torch is never loaded by another.

    The cached library is code this process will run, so the folder must be this user's and not
    writable by others (nor may its parent let others replace it); otherwise a private folder under
    the temporary directory is used instead, with a warning (`cache_problem`)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions")
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}".replace("+", "_")
    directory = Path(base) / f"{name}-{tag}"
    problem = cache_problem(directory)
    if problem is None:
        return directory
    private = Path(tempfile.gettempdir()) / f"moetron-torch-extensions-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    fallback = private / directory.name
    if cache_problem(fallback) is not None:
        raise CppBuildError(f"no safe folder to build {name} in: {problem}; and {cache_problem(fallback)}")
    warnings.warn(f"{problem}: building {name} in {fallback} instead (set TORCH_EXTENSIONS_DIR to a folder of "
                  "your own that others cannot write)")
    return fallback


def cache_problem(directory: Path) -> str | None:
    """Why a library cached in `directory` could be someone else's code, or None when it is safe."""
    uid = os.getuid()
    for path, role in ((directory, "the C++ build cache"), (directory.parent, "its parent folder")):
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if role == "its parent folder" and st.st_mode & stat.S_ISVTX:
            continue  # a sticky folder (/tmp): others cannot rename our folder away
        if st.st_uid != uid:
            return f"{role} {path} belongs to user {st.st_uid}, not to this user ({uid})"
        if st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getgid()):  # a private group is fine
            return f"{role} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    text = (errors or lines or [type(exc).__name__])[0]
    return text if len(text) <= 200 else text[:197] + "..."


def load_permute_ops(verbose: bool = False):
    """Build (first time on this machine) and load the extension; return `torch.ops.moetron_permute`."""
    global _result, _build_seconds
    if _result is not None and _result[0]:  # loaded: no lock on the per-call path of the kernels
        return torch.ops.moetron_permute
    with _lock:
        start = time.perf_counter()
        if _result is None and _load_built_copy():
            _result, _build_seconds = (True, "loaded the cached build"), time.perf_counter() - start
        if _result is None:
            reason = _missing_tool()
            if reason is not None:
                _result = (False, reason)
            else:
                try:
                    from torch.utils.cpp_extension import load

                    directory = build_directory()
                    directory.mkdir(parents=True, exist_ok=True)
                    copy = _built_copy(directory)  # named by the inputs as they are before the build
                    load(name=EXTENSION_NAME, sources=[str(s) for s in _sources()], extra_cflags=CFLAGS,
                         extra_ldflags=LDFLAGS, build_directory=str(directory),
                         is_python_module=False, verbose=verbose)
                    _result = (True, "built")
                    _keep_built_copy(directory, copy)
                except Exception as exc:  # a compiler error, a missing header, a load failure
                    log.debug("building %s failed", EXTENSION_NAME, exc_info=True)
                    _result = (False, f"building {' + '.join(s.name for s in _sources())} failed: {_one_line(exc)}")
                _build_seconds = time.perf_counter() - start
    ok, reason = _result
    if not ok:
        raise CppBuildError(reason)
    return torch.ops.moetron_permute


def _inputs_hash() -> str | None:
    """A digest of everything the library is built from, or None when a source is missing."""
    digest = hashlib.sha256(repr((EXTENSION_NAME, CFLAGS, LDFLAGS, torch.__version__, sys.version)).encode())
    for source in _inputs():
        try:
            digest.update(source.read_bytes())
        except OSError:
            return None
    return digest.hexdigest()[:20]


def _built_copy(directory: Path) -> Path | None:
    digest = _inputs_hash()
    return None if digest is None else directory / f"{EXTENSION_NAME}-{digest}.so"


def _load_built_copy() -> bool:
    """Load the copy of an earlier build of these very inputs, if there is one we own (see the module
    docstring); False (nothing loaded) sends the caller through `torch.utils.cpp_extension.load`."""
    try:
        directory = build_directory()
    except CppBuildError:
        return False
    path = _built_copy(directory)
    if path is None or not path.is_file() or cache_problem(directory) is not None:
        return False
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022:  # only our own, unwritable by others
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError):  # removed meanwhile, or not loadable here: build or load it the ordinary way
        log.debug("loading %s failed", path, exc_info=True)
        return False
    return True


def _keep_built_copy(directory: Path, path: Path | None) -> None:
    """Copy the library just built (or found up to date) to `path`, its input-hashed name, atomically."""
    built = directory / f"{EXTENSION_NAME}.so"
    if path is None or path.exists() or not built.is_file():
        return
    tmp = None
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".tmp-", suffix=".so", delete=False) as tmp:
            tmp.write(built.read_bytes())
        os.chmod(tmp.name, 0o755)
        os.replace(tmp.name, path)
    except OSError:  # a read-only cache: every start-up goes through cpp_extension.load, as before
        log.debug("keeping a copy of %s failed", built, exc_info=True)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp.name)


def cpp_status(build: bool = False) -> tuple[bool, str]:
    """`(available, reason)`. Without `build`, report only what is known without compiling."""
    if _result is None and not build:
        reason = _missing_tool()
        return (False, reason) if reason else (True, "C++ CPU kernel (built on first use, then cached)")
    try:
        load_permute_ops()
    except CppBuildError as exc:
        return False, str(exc)
    return True, f"C++ CPU kernel ({'loaded' if _build_seconds is None else f'loaded in {_build_seconds:.1f}s'})"


def build_seconds() -> float | None:
    """Seconds the first `load_permute_ops` call in this process took (build or cache load)."""
    return _build_seconds


def load_swiglu_ops(verbose: bool = False):
    """The fused SwiGLU ops of the same library (`torch.ops.moetron_swiglu`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_swiglu


def load_norm_ops(verbose: bool = False):
    """The CPU RMSNorm and RoPE of the same library (`torch.ops.moetron_norm`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_norm


def load_router_ops(verbose: bool = False):
    """The CPU softmax top-k router of the same library (`torch.ops.moetron_router`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_router


def load_grouped_gemm_ops(verbose: bool = False):
    """The CPU grouped GEMM of the same library (`torch.ops.moetron_gemm`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_gemm


def load_attention_ops(verbose: bool = False):
    """The CPU causal attention of the same library (`torch.ops.moetron_attention`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_attention


def load_cross_entropy_ops(verbose: bool = False):
    """The CPU token cross-entropy of the same library (`torch.ops.moetron_ce`); see `load_permute_ops`."""
    load_permute_ops(verbose)
    return torch.ops.moetron_ce


"""The package's shape (docs/architecture.md): layers enforced by import-linter, no import cycles,
files a reader can hold in their head, and imports inside functions only for optional packages."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "moetron"
LINT = Path(sys.executable).with_name("lint-imports")
# Modules that may be imported inside a function: optional packages and private torch APIs.
OPTIONAL = ("triton", "transformer_engine", "deep_ep", "flash_attn", "grouped_gemm", "tokenizers", "tensorboard",
            "transformers", "wandb", "torch.distributed._symmetric_memory", "torch.distributed.c10d_logger",
            "torch._C._autograd", "torch.utils.cpp_extension", "torch.utils.tensorboard",
            "moetron.kernels.triton_permute", "moetron.kernels.triton_swiglu", "moetron.kernels.triton_rmsnorm",
            "moetron.kernels.triton_router", "moetron.kernels.triton_cross_entropy", "moetron.kernels.triton_rope",
            "torch.distributed.fsdp", "torch.distributed.device_mesh")  # the last two: ZeRO-3 only, ~0.5 s to import
# The package root and the command line's entry import torch-loading modules on first use: OpenMP's wait
# policy must be set before torch loads its OpenMP runtime (moetron/__main__.py).
LAUNCH = {"moetron/__init__.py": ("moetron.moe.config.MoEConfig", "moetron.moe.layer.MoELayer"),
          "moetron/__main__.py": ("moetron.cli.main",)}


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(cwd), "PATH": str(LINT.parent)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_import_linter_contracts_hold():
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout and result.stdout.count("KEPT") >= 2


def test_import_linter_catches_an_upward_import(tmp_path):
    """A deliberately wrong import (parallel/ reaching up into train/) breaks the layers contract."""
    shutil.copytree(PACKAGE, tmp_path / "moetron", ignore=shutil.ignore_patterns("__pycache__", "files"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    comm = tmp_path / "moetron" / "parallel" / "comm.py"
    comm.write_text(comm.read_text() + "\nfrom moetron.train import trainer  # a deliberate layer violation\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "moetron.parallel.comm -> moetron.train.trainer" in result.stdout


def test_no_import_cycles_between_modules():
    graph = grimp.build_graph("moetron")
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if module.startswith(imported + ".") or imported.startswith(module + "."):
                continue  # a module and its own package
            assert not graph.chain_exists(importer=imported, imported=module), \
                f"import cycle: {module} -> {imported} -> ... -> {module}"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_library_file_is_short_and_imports_at_the_top(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 500, f"{path.relative_to(ROOT)} is over 500 lines: split it by concept"
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                assert name.startswith(OPTIONAL) or name in LAUNCH.get(str(path.relative_to(ROOT)), ()), (
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {name} inside a function; move it to the "
                    f"top (only optional packages are imported lazily)")


def test_public_import_paths_keep_working():
    from moetron import MoEConfig, MoELayer
    from moetron.bridge import from_hf, to_hf
    from moetron.integrations.hf import patch as old_name
    from moetron.integrations.transformers import patch
    from moetron.pipeline import simulate

    assert old_name is patch and callable(from_hf) and callable(to_hf) and callable(simulate)
    assert MoELayer(MoEConfig(hidden_size=8, ffn_hidden_size=8, num_experts=4, top_k=2)).config.num_experts == 4

"""Import one of moetron's Triton kernel modules interpreted (`TRITON_INTERPRET=1`), for CPU tests."""

import importlib
import importlib.util
import os

import pytest


def load_triton_interpreted(name: str):
    """`(module, None)`, or `(None, why the tests must skip)`. Triton decides at a kernel's decoration
    whether it interprets, so the variable is set while `name` is imported (and put back after)."""
    if importlib.util.find_spec("triton") is None:
        return None, "python package 'triton' is not installed (CI installs it with the test extras)"
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module(name)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    if not module.INTERPRET:
        return None, f"{name} was imported without TRITON_INTERPRET=1"
    return module, None


def interpreted_kernels(name: str):
    """A pytest fixture giving module `name` imported interpreted, or skipping the test with the reason."""
    module, why = load_triton_interpreted(name)

    @pytest.fixture
    def kernels():
        if why:
            pytest.skip(why)
        return module

    return kernels

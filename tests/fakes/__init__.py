"""Signature-faithful CPU fakes of the GPU libraries moetron calls (docs/fp8.md, DESIGN "Testing").

Each fake copies the library's call signatures, return types and host-side checks from its source
(the version followed is named at the top of each package) and implements the semantics with torch
on the CPU. It declares itself with `MOETRON_CPU_FAKE` (read by `moetron.backends.cpu_fake`), so
moetron reports "a CPU fake of ..." instead of pretending a GPU library is present.

    with fakes.installed("transformer_engine", "flash_attn"):   # importable only inside
        ...
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys

FAKES_DIR = os.path.dirname(os.path.abspath(__file__))
NAMES = ("transformer_engine", "flash_attn", "grouped_gemm")


def _purge(name: str) -> None:
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def install(*names: str) -> None:
    """Make the named fakes importable (and import them) for the rest of this process."""
    for name in names:
        if name not in NAMES:
            raise ValueError(f"no fake named {name!r}; have {NAMES}")
        _purge(name)
    if FAKES_DIR not in sys.path:
        sys.path.insert(0, FAKES_DIR)
    for name in names:
        module = importlib.import_module(name)
        assert getattr(module, "MOETRON_CPU_FAKE", None), f"{module.__file__} is not a fake"


def uninstall(*names: str) -> None:
    for name in names:
        _purge(name)
    if FAKES_DIR in sys.path:
        sys.path.remove(FAKES_DIR)


@contextlib.contextmanager
def installed(*names: str):
    install(*names)
    try:
        yield
    finally:
        uninstall(*names)

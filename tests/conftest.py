"""Session-wide test set-up."""

import os

import torch

# Triton decides between compiling and interpreting when a kernel is decorated, i.e. at import.
# Without a GPU its kernels can only run interpreted, so ask for that before any test imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

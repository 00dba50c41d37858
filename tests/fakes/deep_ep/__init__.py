"""CPU fake of DeepEP's Python API (`deep_ep.Buffer`, `Config`, `EventOverlap`, `topk_idx_t`).

Follows deepseek-ai/DeepEP 2.1.0 at commit dd758caf451848bd150e1046af3d0a73e5fff38d (2026-07-14):
`deep_ep/buffers/legacy.py` (the `Buffer` API: normal intranode and low-latency modes),
`deep_ep/utils/event.py` (EventOverlap), host asserts of `csrc/legacy/buffer.hpp` and
`csrc/legacy/config.hpp`, and the launch-time limits of `csrc/kernels/legacy/` (top-k <= 32 columns,
low-latency top-k <= 11 and hidden sizes 2048 ... 8192). Same signatures, return tuples, dtypes and
host checks; the transfers are gloo collectives on CPU. Asynchronous outputs hold poison (NaN, or
-7777 for integers) until their event (or receive hook) is waited on; low-latency blocks are placed
in a shuffled arrival order, with column-major FP8 scales, as DeepEP returns them.
Internode (more than 8 ranks) is not emulated. Fake-only helpers: `live_buffers()`, `host_asserts`.
"""

from deep_ep.buffer import Buffer, live_buffers
from deep_ep.config import Config, EPHostAssert, host_asserts
from deep_ep.event import EventHandle, EventOverlap

import torch

MOETRON_CPU_FAKE = "DeepEP 2.1.0 (deepseek-ai/DeepEP@dd758caf)"
__version__ = "2.1.0"
topk_idx_t = torch.int64

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "EPHostAssert", "topk_idx_t", "live_buffers",
           "host_asserts"]

"""transformer_engine/pytorch/module/base.py (fake, TE 2.20.0.dev0 @d0067d0d): the Userbuffers API
(`initialize_ub`, `get_ub`, `get_ub_is_fp8`, `destroy_ub`, `is_ub_initialized`,
`UserBufferQuantizationMode`) with TE's arguments, its per-GEMM defaults (method, AG or RS, FP8
buffer) and its host checks, plus the checks of the communicator's `copy_into_buffer` / `get_buffer`
(comm_gemm_overlap.cpp) and of `fill_userbuffers_buffer_for_all_gather`.

As TE does, `initialize_ub` builds its own tensor-parallel domains: consecutive blocks of `tp_size`
global ranks (a `new_subgroups_by_enumeration` over a `bootstrap_backend` world group); a
communicator exchanges within its domain, not within the `tp_group` a module is given. The
exchanges are torch point-to-point rings over that group (gloo on CPU): an all-gather in tp steps
(TE's ring_exchange / bulk AG) and a reduce-scatter that adds each arriving partial to this rank's
GEMM chunk (TE's pipeline / bulk RS); same values as TE's kernels. Not kept: the CUDA multicast
probe, MPI bootstrap, cuBLASMp (refused), atomic GEMM, SM / stream settings (accepted, unused).
`ub_log` records every exchange, `(ub name, "AG" | "RS", use_fp8)`: what tests inspect.
"""

import math
import warnings
from enum import Enum
from typing import List, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["initialize_ub", "destroy_ub", "is_ub_initialized", "using_cublasmp_backend", "UserBufferQuantizationMode"]

_ub_communicators = None
_ub_initialized = False
ub_log: list = []  # (name, "AG" | "RS", use_fp8) per exchange


def is_ub_initialized() -> bool:
    """Whether the Userbuffers communicators have been initialized."""
    return _ub_initialized


def using_cublasmp_backend() -> bool:
    return False


class UserBufferQuantizationMode(Enum):
    NONE = "none"
    FP8 = "fp8"


class _CommOverlap:
    """tex.CommOverlap / CommOverlapP2P: a [rows, cols] buffer of `dtype` (uint8 for FP8 buffers)
    shared by the `tp_size` ranks of `group`, exchanged with AG or RS."""

    def __init__(self, name, shape, dtype, group, tp_size, comm_type, method, fp8_buf, mode):
        self.name, self.shape, self.dtype, self.group = name, list(shape), dtype, group
        self.tp_size, self.comm_type, self.method, self.mode = tp_size, comm_type, method, mode
        self._fp8 = fp8_buf
        self.tp_id = dist.get_rank(group) % tp_size
        self._ubuf = torch.empty(self.shape, dtype=dtype)

    def is_fp8_ubuf(self) -> bool:
        return self._fp8

    def with_cublasmp(self) -> bool:
        return False

    def is_atomic_gemm(self) -> bool:
        return False

    def _check(self, numel: int, element_size: int, local_chunk: bool) -> None:
        if self._ubuf.element_size() != element_size:
            raise RuntimeError("Tried to copy data into a Userbuffers buffer but dtypes are not compatible "
                               f"(input dtype has {element_size} bytes, UB dtype has {self._ubuf.element_size()} bytes)")
        ubuf_size = self._ubuf.numel()
        if local_chunk and numel * self.tp_size != ubuf_size:
            raise RuntimeError("Tried to copy an invalid tensor into a local chunk of a Userbuffers buffer "
                               f"(input_size={numel}, tensor_parallel_size={self.tp_size}, ubuf_size={ubuf_size})")
        if not local_chunk and numel != ubuf_size:
            raise RuntimeError(f"Tried to copy an invalid tensor into a Userbuffers buffer (input_size={numel}, "
                               f"ubuf_size={ubuf_size})")

    def copy_into_buffer(self, inp: torch.Tensor, local_chunk: bool = False) -> None:
        self._check(inp.numel(), inp.element_size(), local_chunk)
        n = inp.numel()
        start = n * self.tp_id if local_chunk else 0
        self._ubuf.view(-1)[start:start + n].copy_(inp.reshape(-1).view(self._ubuf.dtype))

    def get_buffer(self, local_chunk: bool = False, shape: Optional[List[int]] = None) -> torch.Tensor:
        if shape is not None:
            req = math.prod(shape)
            if (req * self.tp_size if local_chunk else req) != self._ubuf.numel():
                raise RuntimeError(f"Invalid shape for a Userbuffers buffer (requested shape={list(shape)}, "
                                   f"ubuf_size={self._ubuf.numel()})")
        else:
            shape = [self.shape[0] // self.tp_size if local_chunk else self.shape[0], self.shape[1]]
        flat = self._ubuf.view(-1)
        n = math.prod(shape)
        return flat[n * self.tp_id:n * (self.tp_id + 1)].view(shape) if local_chunk else flat.view(shape)

    # ---- the exchanges (the fake's torch rings) ----

    def _ring(self):
        ranks = dist.get_process_group_ranks(self.group)
        r = self.tp_id
        return ranks[(r + 1) % self.tp_size], ranks[(r - 1) % self.tp_size]

    def _swap(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        nxt, prv = self._ring()
        ops = [dist.P2POp(dist.isend, send.contiguous(), nxt, self.group),
               dist.P2POp(dist.irecv, recv, prv, self.group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def all_gather(self, local: torch.Tensor, recipe=None) -> torch.Tensor:
        """Ring all-gather of `local` [rows/tp, cols] along rows, through this buffer (`recipe`: the FP8
        recipe its data is quantized with, None when not FP8)."""
        fill_userbuffers_buffer_for_all_gather(self, local, recipe)
        chunks = [None] * self.tp_size
        chunks[self.tp_id] = cur = local.contiguous()
        for step in range(1, self.tp_size):  # each step: GEMM on the chunk held, pass it on
            nxt = torch.empty_like(cur)
            self._swap(cur, nxt)
            chunks[(self.tp_id - step) % self.tp_size] = cur = nxt
        ub_log.append((self.name, "AG", recipe is not None))
        return torch.cat(chunks)

    def reduce_scatter(self, full: torch.Tensor, use_fp8: bool) -> torch.Tensor:
        """Ring reduce-scatter of `full` [rows, cols] (this rank's partial GEMM output) along rows."""
        if self.comm_type != "RS":
            raise RuntimeError(f"{self.name}: a reduce-scatter through an all-gather communicator")
        self._check(full.numel(), full.element_size(), False)
        parts = full.chunk(self.tp_size)
        acc = parts[(self.tp_id - 1) % self.tp_size].clone()
        for step in range(1, self.tp_size):  # chunk (r - s - 1): add the neighbour's partial sum
            got = torch.empty_like(acc)
            self._swap(acc, got)
            acc = got + parts[(self.tp_id - step - 1) % self.tp_size]
        ub_log.append((self.name, "RS", use_fp8))
        return acc


def fill_userbuffers_buffer_for_all_gather(comm: _CommOverlap, local_tensor: torch.Tensor, recipe=None) -> None:
    """TE's checks before an AG (the fake's tensors are dequantized: FP8 data counts 1 byte per element)."""
    if local_tensor.dim() == 0:
        raise ValueError(f"Invalid local tensor (shape={tuple(local_tensor.size())})")
    use_fp8 = recipe is not None
    if use_fp8 and recipe.float8_block_scaling():
        raise ValueError(f"Unsupported quantizer for Userbuffers ({type(recipe).__name__})")
    if use_fp8 and recipe.mxfp8() and math.prod(local_tensor.shape[:-1]) % 128 != 0:
        raise ValueError("Userbuffers requires MXFP8 tensor dims that are divisible by 128, but got MXFP8 tensor "
                         f"with shape={tuple(local_tensor.shape)}")
    if comm.comm_type != "AG":
        raise RuntimeError(f"{comm.name}: an all-gather through a reduce-scatter communicator")
    if not use_fp8 and comm.is_fp8_ubuf():
        raise RuntimeError("Attempting to all-gather unquantized tensor, but Userbuffers is initialized with FP8 buffers")
    if use_fp8 and not comm.is_fp8_ubuf():
        raise RuntimeError("Attempting to all-gather FP8 tensor, but Userbuffers is not initialized with FP8 buffers")
    comm._check(local_tensor.numel(), 1 if use_fp8 else local_tensor.element_size(), True)


def initialize_ub(shape: list, tp_size: int, use_fp8: bool = False,
                  quantization_modes: List[UserBufferQuantizationMode] = None, dtype: torch.dtype = torch.bfloat16,
                  ub_cfgs: Optional[Union[dict, List[dict]]] = None,
                  bootstrap_backend: Union[str, "dist.Backend"] = None, with_cublasmp: bool = False) -> None:
    if with_cublasmp:
        raise RuntimeError("Comm+GEMM overlap with cuBLASMp backend requires TE to be built with NVTE_WITH_CUBLASMP=1.")
    if not quantization_modes:
        warnings.warn("Initializing Userbuffers with use_fp8 is deprecated. Please use quantization_modes instead.",
                      DeprecationWarning)
        quantization_modes = [UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE]
    else:
        if not isinstance(quantization_modes, list):
            raise TypeError(f"quantization_modes must be a list, got {type(quantization_modes).__name__}")
        invalid = [m for m in quantization_modes if not isinstance(m, UserBufferQuantizationMode)]
        if invalid:
            raise TypeError(f"quantization_modes must be a list of UserBufferQuantizationMode, got invalid entries: "
                            f"{invalid}")
    if isinstance(ub_cfgs, dict) or ub_cfgs is None:
        ub_cfgs = [ub_cfgs] * len(quantization_modes)
    elif len(ub_cfgs) != len(quantization_modes):
        raise ValueError(f"Number of ub_cfgs settings ({len(ub_cfgs)}) must match number of quantization "
                         f"configurations ({len(quantization_modes)})")
    global _ub_communicators, _ub_initialized
    if _ub_communicators is not None:
        raise RuntimeError("UB communicators are already initialized.")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before using Userbuffers")
    if bootstrap_backend is None:
        bootstrap_backend = "mpi" if dist.is_mpi_available() else "gloo" if dist.is_gloo_available() else "nccl"
    elif bootstrap_backend not in ["gloo", "mpi", "nccl"]:
        raise ValueError(f"Invalid torch.distributed backend '{bootstrap_backend}' for bootstrapping Userbuffers. "
                         "Must be one of: 'gloo', 'mpi', 'nccl'")
    _ub_communicators = {}
    world_group = dist.new_group(backend=bootstrap_backend)
    world_size = dist.get_world_size(world_group)
    num_domains = world_size // tp_size
    if num_domains > 1:
        ranks = [[i * tp_size + t for t in range(tp_size)] for i in range(num_domains)]
        domain, _ = dist.new_subgroups_by_enumeration(ranks, backend=bootstrap_backend)
    else:
        domain = world_group
    if len(shape) != 2:
        raise RuntimeError("Userbuffer shape must be 2-dimensional!")

    layers_all_gather_overlap = ["qkv_fprop", "qkv_dgrad", "proj_dgrad", "proj_wgrad", "fc1_fprop", "fc1_dgrad",
                                 "fc2_dgrad", "fc2_wgrad"]
    layers_reduce_scatter_overlap = ["proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"]
    methods = {"ring_exchange": ["qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"],
               "pipeline": ["proj_fprop", "fc2_fprop"], "bulk": ["qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"],
               "external": ["proj_wgrad", "fc2_wgrad"]}
    for mode, user_cfg in zip(quantization_modes, ub_cfgs):
        for method, names in methods.items():
            for name in names:
                cfg = {"method": method, "is_reduce_scatter": name in layers_reduce_scatter_overlap,
                       "fp8_buf": name in layers_all_gather_overlap}
                if user_cfg is not None and name in user_cfg:
                    fp8_buf = name in layers_all_gather_overlap or (
                        user_cfg[name].get("fp8_buf", False) and name in methods["pipeline"])
                    cfg.update(user_cfg[name])
                    cfg["fp8_buf"] = fp8_buf
                if not cfg["is_reduce_scatter"] and cfg["method"] == "pipeline":
                    raise ValueError(f"At {name}, `pipeline` overlap method is not supported for AllGather.")
                fp8 = mode == UserBufferQuantizationMode.FP8 and cfg["fp8_buf"]
                _ub_communicators[(name, mode)] = _CommOverlap(
                    name, shape, torch.uint8 if fp8 else dtype, domain, tp_size,
                    "RS" if cfg["is_reduce_scatter"] else "AG", cfg["method"], fp8, mode)
    _ub_initialized = True


def get_ub(name: str, use_fp8: bool):
    """Get userbuffer communicator corresponding to give key."""
    key = (name, UserBufferQuantizationMode.FP8 if use_fp8 else UserBufferQuantizationMode.NONE)
    if not _ub_initialized or _ub_communicators is None:
        raise RuntimeError("UB manager is not initialized.")
    if key not in _ub_communicators:
        raise KeyError(f"UB for {name} with use_fp8={use_fp8} is not registered.")
    return _ub_communicators[key]


def get_ub_is_fp8(name: str, use_fp8: bool) -> bool:
    return get_ub(name, use_fp8).is_fp8_ubuf()


def destroy_ub():
    """Destroy all allocated userbuffer communicators."""
    global _ub_communicators, _ub_initialized
    _ub_communicators = None
    _ub_initialized = False

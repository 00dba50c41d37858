"""Accelerator presets for `moetron plan`: memory, dense peaks, memory and link bandwidths, NVLink domain.

Data only, one entry per `--gpu` name; each figure carries its public source. Bandwidths are per GPU and
per direction (what one GPU can push while receiving the same), in GB/s (1e9 bytes). Peaks are dense (no
2:4 sparsity). How the planner uses them: docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float  # HBM per GPU (GiB as sold: the vendors' "GB" of HBM are GiB-sized stacks)
    bf16_tflops: float  # dense BF16 tensor-core peak
    fp8_tflops: float  # dense FP8 tensor-core peak
    hbm_tbps: float  # HBM bandwidth, TB/s
    nvlink_gbps: float  # NVLink, per GPU per direction, GB/s
    scaleout_gbps: float  # InfiniBand / RoCE NIC per GPU per direction, GB/s
    nvlink_domain: int  # GPUs one NVLink domain joins (the default --gpus-per-node)


GPUS: dict[str, GPU] = {
    # H100 SXM5: 80 GB HBM3, 3.35 TB/s, BF16 989.5 / FP8 1979 dense TFLOPS, NVLink 4 900 GB/s total
    # (450 per direction) -- NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100);
    # DGX H100: one ConnectX-7 400 Gb/s (50 GB/s) NIC per GPU, 8 GPUs per NVLink domain (DGX H100 user guide).
    "h100": GPU("h100", 80, 989.5, 1979, 3.35, 450, 50, 8),
    # H800 SXM: the H100 die with NVLink cut to 400 GB/s total (200 per direction); DeepSeek-V3 technical
    # report (arXiv 2412.19437, section 3.1): "NVLink ~160 GB/s" achieved, 8 GPUs per node, one 400 Gb/s
    # InfiniBand NIC per GPU ("IB ~50 GB/s"). Compute and HBM as H100 SXM.
    "h800": GPU("h800", 80, 989.5, 1979, 3.35, 200, 50, 8),
    # H200 SXM: 141 GB HBM3e, 4.8 TB/s, same tensor cores and NVLink as H100 SXM -- NVIDIA H200 datasheet
    # (nvidia.com/en-us/data-center/h200); HGX H200 with 400 Gb/s NICs per GPU.
    "h200": GPU("h200", 141, 989.5, 1979, 4.8, 450, 50, 8),
    # B200 (DGX B200): 1,440 GB HBM3e and 64 TB/s for 8 GPUs; 72 PFLOPS FP8 training for 8 GPUs with
    # sparsity, i.e. 4.5 PF dense FP8 and 2.25 PF dense BF16 per GPU; NVLink 5 1.8 TB/s total (900 per
    # direction) -- NVIDIA DGX B200 datasheet; 8 x ConnectX-7 400 Gb/s.
    "b200": GPU("b200", 180, 2250, 4500, 8.0, 900, 50, 8),
    # GB200 NVL72: 186 GB HBM3e and 8 TB/s per GPU (13.4 TB / 576 TB/s for 72), dense BF16 2.5 PF / FP8
    # 5 PF per GPU (180 / 360 PF for 72), NVLink 5 1.8 TB/s total, 72 GPUs in one NVLink domain -- NVIDIA
    # GB200 NVL72 product page (nvidia.com/en-us/data-center/gb200-nvl72); ConnectX-7 400 Gb/s per GPU.
    "gb200": GPU("gb200", 186, 2500, 5000, 8.0, 900, 50, 72),
    # A CPU "device" for the gloo worked example (docs/planning.md): 2 cores of a laptop/CI box, ~50 GFLOPS
    # fp32 each, ~10 GB/s memory, loopback gloo ~1 GB/s. Rough by nature; there is no datasheet.
    "cpu": GPU("cpu", 4, 0.1, 0.1, 0.01, 1, 1, 2),
}


def get_gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"--gpu {name!r} is unknown; choose one of {', '.join(GPUS)}")
    return GPUS[name]

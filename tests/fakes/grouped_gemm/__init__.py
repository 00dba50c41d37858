"""CPU fake of fanshiqing/grouped_gemm (commit 15721c6f, Dec 2025): `ops.gmm` with the host checks of
`csrc/grouped_gemm.cu::GroupedGemm` (bf16 only, contiguous, batch_sizes a 1-D CPU int64 tensor)."""

MOETRON_CPU_FAKE = "fanshiqing/grouped_gemm@15721c6f"

from grouped_gemm import backend, ops  # noqa: E402,F401

"""transformer_engine/common/recipe/__init__.py (TE 2.20.0.dev0 @d0067d0d): the recipes' fields,
defaults and asserts (NVTE_* environment defaults taken as unset)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Literal, NamedTuple, Optional, Union


class _FormatHelper(NamedTuple):
    max_fwd: float
    max_bwd: float


class Format(Enum):
    E4M3 = _FormatHelper(max_fwd=448, max_bwd=448)
    E5M2 = _FormatHelper(max_fwd=57344, max_bwd=57344)
    HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)


@dataclass()
class QParams:
    power_2_scale: bool = False
    amax_epsilon: float = 0.0


class Recipe:
    """Base recipe; the predicates TE's modules dispatch on."""

    def mxfp8(self):
        return isinstance(self, MXFP8BlockScaling)

    def delayed(self):
        return isinstance(self, DelayedScaling)

    def float8_current_scaling(self):
        return isinstance(self, Float8CurrentScaling)

    def float8_per_tensor_scaling(self):
        return isinstance(self, (DelayedScaling, Float8CurrentScaling))

    def float8_block_scaling(self):
        return isinstance(self, Float8BlockScaling)

    def nvfp4(self):
        return False

    def custom(self):
        return False


def _check_fmt(fmt):
    assert fmt != Format.E5M2, "Pure E5M2 training is not supported."
    assert fmt in (Format.E4M3, Format.HYBRID), f"unsupported fp8_format {fmt}"


@dataclass()
class DelayedScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: Union[Literal["max", "most_recent"], Callable] = "max"
    scaling_factor_compute_algo: Optional[Callable] = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fmt(self.fp8_format)
        assert self.amax_compute_algo in ("max", "most_recent") or callable(self.amax_compute_algo)


@dataclass()
class Float8CurrentScaling(Recipe):
    use_power_2_scales: bool = False
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams = field(default_factory=QParams)
    fp8_quant_fwd_weight: QParams = field(default_factory=QParams)
    fp8_quant_bwd_grad: QParams = field(default_factory=QParams)
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        _check_fmt(self.fp8_format)
        for q in (self.fp8_quant_fwd_inp, self.fp8_quant_fwd_weight, self.fp8_quant_bwd_grad):
            q.power_2_scale = self.use_power_2_scales


@dataclass()
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        _check_fmt(self.fp8_format)


@dataclass()
class Float8BlockScaling(Recipe):
    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_fwd_weight: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    fp8_quant_bwd_grad: QParams = field(default_factory=lambda: QParams(power_2_scale=True))
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        assert self.x_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for x"
        assert self.w_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for w"
        assert self.grad_block_scaling_dim in [1, 2], "Only 1D or 2D blocks supported for grad"
        assert not (self.x_block_scaling_dim == 2 and self.grad_block_scaling_dim == 2), \
            "2D by 2D block gemm not supported."
        assert not self.fp8_dpa and not self.fp8_mha, "FP8 attention is not supported for Float8BlockScaling."
        _check_fmt(self.fp8_format)

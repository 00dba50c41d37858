"""TrainConfig: optimisation, batch and logging settings of a run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 8
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 1
    metrics_file: str | None = None
    data: str = "builtin"  # "builtin" (the Python standard library's sources, byte-tokenized) or a
    # folder made by `moetron data prepare`
    data_mask_boundary: bool = False  # ignore the label after each document separator
    tensorboard_dir: str | None = None  # needs the `tensorboard` package
    peak_tflops: float | None = None  # the device's peak, for the MFU estimate
    save_dir: str | None = None  # checkpoints go to SAVE_DIR/step-NNNNNNNN/
    save_every: int = 0  # steps between checkpoints; 0 saves only at the end (when save_dir is set)
    resume: bool = False  # continue from SAVE_DIR/latest when it exists
    init_hf: str | None = None  # start from this Hugging Face folder's weights (unless resuming)
    export_hf: str | None = None  # after the last step, write the final checkpoint here as a hub folder
    fp8: str | None = None  # FP8 recipe for linear layers and experts: tensorwise, delayed, blockwise
    fp8_backend: str = "auto"  # auto, emulate, torch (torch._scaled_mm), te (Transformer Engine)
    dtype: str = "fp32"  # parameters: fp32, or bf16 (with fp32 gradients, master weights and moments)
    device: str = "auto"  # auto (this rank's GPU when CUDA is available, else the CPU), cpu, cuda
    fusion: str = "none"  # elementwise kernels: none (eager reference) or compile (torch.compile'd, same math)
    on_nonfinite: str = "stop"  # a NaN/inf loss or gradient norm: "stop" (raise) or "skip" the update
    collective_timeout_s: float = 1800.0  # how long a collective waits for a dead or stuck rank

    def __post_init__(self) -> None:
        for name in ("steps", "seq_len", "micro_batch_size", "grad_accum", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"TrainConfig.lr={self.lr} must be > 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.save_every < 0:
            raise ValueError(f"TrainConfig.save_every={self.save_every} must be >= 0")
        if self.export_hf and not self.save_dir:
            raise ValueError("TrainConfig.export_hf needs train.save_dir: the export is made from the final "
                             "checkpoint")
        if self.resume and not self.save_dir:
            raise ValueError("TrainConfig.resume=true needs train.save_dir")
        if self.warmup_steps < 0:
            raise ValueError(f"TrainConfig.warmup_steps={self.warmup_steps} must be >= 0")
        if self.dtype not in ("fp32", "bf16"):
            raise ValueError(f"TrainConfig.dtype={self.dtype!r}: choose fp32 or bf16")
        if self.fusion not in ("none", "compile"):
            raise ValueError(f"TrainConfig.fusion={self.fusion!r}: choose none or compile")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"TrainConfig.device={self.device!r}: choose auto, cpu or cuda")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"TrainConfig.on_nonfinite={self.on_nonfinite!r}: choose 'stop' (raise an error "
                             "naming the step and rank) or 'skip' (drop that step's update and go on)")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"TrainConfig.collective_timeout_s={self.collective_timeout_s} must be > 0 (seconds a "
                             "collective waits for the other ranks before failing)")
        if self.fp8 is not None and self.fp8 not in ("tensorwise", "delayed", "blockwise"):
            raise ValueError(f"TrainConfig.fp8={self.fp8!r}: choose tensorwise, delayed or blockwise (or null)")
        if self.data != "builtin":
            from moetron.data.prepare import is_prepared

            if not is_prepared(self.data):
                raise ValueError(f"TrainConfig.data={self.data!r}: not 'builtin' nor a folder made by "
                                 "`moetron data prepare INPUT... --tokenizer tokenizer.json --output FOLDER`")
        if self.tensorboard_dir:
            from moetron.train.progress import require_tensorboard

            try:
                require_tensorboard()
            except ImportError as exc:
                raise ValueError(str(exc)) from None

    def lr_at(self, step: int) -> float:
        """Linear warm-up then cosine decay to `lr * min_lr_ratio` (step counts from 0)."""
        import math

        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

"""Tensors on disk under any layout: safetensors reading/writing (slices, safetensors_io), the
sharded layout-independent store (sharded) and training checkpoints (training). Both the trainer
and the Hugging Face bridge call down into this package."""

from moetron.checkpoint.slices import CheckpointError

__all__ = ["CheckpointError"]

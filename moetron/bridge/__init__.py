"""Hugging Face checkpoints in and out."""

from moetron.bridge.hf import from_hf, to_hf
from moetron.bridge.hf_config import config_from_hf, config_to_hf
from moetron.checkpoint.safetensors_io import CheckpointError

__all__ = ["CheckpointError", "config_from_hf", "config_to_hf", "from_hf", "to_hf"]

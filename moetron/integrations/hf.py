"""The former name of `moetron.integrations.transformers` (renamed beside `moetron.bridge.hf`, which
reads checkpoints); kept so `from moetron.integrations.hf import patch` goes on working."""

from moetron.integrations.transformers import SUPPORTED_BLOCKS, ExpertGroups, HFMoELayer, full_state_dict, patch

__all__ = ["ExpertGroups", "HFMoELayer", "SUPPORTED_BLOCKS", "full_state_dict", "patch"]

"""GLM-5.3-Flash (transformers ``glm5_next``) in genoctx: config, layers, model, HF checkpoints."""

from .config import ModelConfig, preset
from .hf import load_hf
from .model import HybridLM

__all__ = ["HybridLM", "ModelConfig", "load_hf", "preset"]

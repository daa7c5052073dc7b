"""HF config + safetensors -> Llama-family modules."""

from models.hf_config import CheckpointError, ModelSpec, load_hf_config, model_spec, resolve_max_model_len
from models.loader import WeightLoadError, build_model
from models.registry import ARCHITECTURES, UnsupportedArchitectureError

__all__ = ["ARCHITECTURES", "CheckpointError", "ModelSpec", "UnsupportedArchitectureError", "WeightLoadError",
           "build_model", "load_hf_config", "model_spec", "resolve_max_model_len"]

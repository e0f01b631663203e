"""Trainable models the small way: parameters are `fl.Tensor` leaves their modules own, found by walking
attributes (`fuel.nn.state`); layers are plain callable classes; `fuel.nn.llama` is a trainable Llama whose
state-dict names are transformers' `LlamaForCausalLM` names."""

from fuel.nn.layers import Embedding, LayerNorm, Linear, RMSNorm
from fuel.nn.llama import Llama, LlamaConfig
from fuel.nn.state import get_parameters, get_state_dict, load_state_dict, safe_load, safe_save

__all__ = ["Embedding", "LayerNorm", "Linear", "Llama", "LlamaConfig", "RMSNorm", "get_parameters",
           "get_state_dict", "load_state_dict", "safe_load", "safe_save"]

"""vllm-av: adaptive verification for speculative decoding in vLLM.

`vllm_av.core` holds the engine-agnostic algorithms; `vllm_av.vllm` is the
adapter that plugs them into vLLM.
"""

__version__ = "0.1.0"

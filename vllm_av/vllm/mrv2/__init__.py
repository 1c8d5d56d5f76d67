"""Model Runner V2 (the GPU default in vLLM 0.32): our estimator and AV
manager in the places vLLM builds its own. See patches.py."""

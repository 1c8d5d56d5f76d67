"""Forced drafting depths for the distribution checks (CPU script and GPU
test), in an engine process that runs the engine core in process.

A forced schedule of depths reads no token, so the output distribution
must stay the target's whatever the schedule; it makes the steps a check
needs (depth-0 steps over holes, steps that verify and draft nothing)
happen for certain."""

from __future__ import annotations

import itertools


def force_depth_cycle(spec: str = "0,K") -> None:
    """Every depth choice from now on takes the next of `spec`'s depths in
    turn ("K" for the verifier's K): "0,K" alternates, "K,0,0" makes the
    step after two depth-0 choices one that verifies and drafts nothing."""
    from vllm_av.core.verifier import AdaptiveVerifier

    cycle = itertools.cycle(spec.split(","))

    def choose_depth(self, *args, **kwargs):
        depth = next(cycle)
        return self.K if depth == "K" else int(depth)

    AdaptiveVerifier.choose_depth = choose_depth


def _count(module, name: str, hit) -> list:
    """Wrap `module.name` so that each call whose result makes
    `hit(result, *args)` true is counted; a one-item list holds the count."""
    count = [0]
    original = getattr(module, name)

    def counted(*args):
        result = original(*args)
        count[0] += bool(hit(result, *args))
        return result

    setattr(module, name, counted)
    return count


def count_plain_steps() -> list:
    """A one-item list holding how many steps ended as plain decoding on
    Model Runner V2 (vllm_av/vllm/mrv2/plain_step.py) so far."""
    import vllm_av.vllm.mrv2.plain_step as plain_step

    return _count(plain_step, "is_plain_step", lambda plain, state: plain)


def count_draft_metadata_skips() -> list:
    """A one-item list holding how many target metadata builds on Model
    Runner V2 left the draft's attention groups out (option
    skip_draft_layer_metadata, vllm_av/vllm/mrv2/draft_metadata.py) so far."""
    import vllm_av.vllm.mrv2.draft_metadata as draft_metadata

    return _count(draft_metadata, "groups_to_build",
                  lambda built, model_state, attn_groups: built is not attn_groups)

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


def count_plain_steps() -> list:
    """A one-item list holding how many steps ended as plain decoding on
    Model Runner V2 (vllm_av/vllm/mrv2/plain_step.py) so far."""
    import vllm_av.vllm.mrv2.plain_step as plain_step

    count = [0]
    decide = plain_step.is_plain_step

    def counted(state):
        plain = decide(state)
        count[0] += plain
        return plain

    plain_step.is_plain_step = counted
    return count


def count_draft_metadata_skips() -> list:
    """A one-item list holding how many target metadata builds on Model
    Runner V2 left the draft's attention groups out (option
    skip_draft_layer_metadata, vllm_av/vllm/mrv2/draft_metadata.py) so far."""
    import vllm_av.vllm.mrv2.draft_metadata as draft_metadata

    count = [0]
    choose = draft_metadata.groups_to_build

    def counted(model_state, attn_groups):
        built = choose(model_state, attn_groups)
        count[0] += built is not attn_groups
        return built

    draft_metadata.groups_to_build = counted
    return count

"""A step that verifies no draft is prepared as plain decoding
(vllm_av/vllm/mrv1/plain_step.py): the runner's `_prepare_inputs` sees no
speculative config exactly when the step carries no draft, our AV serves
the runner and the model is attention-only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
from vllm_av.vllm.mrv1.patches import runs_plain  # noqa: E402
from vllm_av.vllm.mrv1.plain_step import PlainZeroDraftStepPatch  # noqa: E402

SPEC = object()


class Runner:
    """Stands in for vLLM's V1 runner: its original `_prepare_inputs`
    reports which speculative config it saw."""

    def __init__(self, options: AVOptions | None, spec_types=None):
        from vllm.v1.kv_cache_interface import FullAttentionSpec

        extra = {} if options is None else {ADDITIONAL_CONFIG_KEY: options.to_dict()}
        self.vllm_config = SimpleNamespace(additional_config=extra)
        self.speculative_config = SPEC
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8,
                                 dtype=None)
        groups = [SimpleNamespace(kv_cache_spec=s) for s in (spec_types or [spec])]
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=groups)

    def _orig__prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        return self.speculative_config


def prepare(runner, drafts: dict):
    so = SimpleNamespace(scheduled_spec_decode_tokens=drafts)
    seen = PlainZeroDraftStepPatch._prepare_inputs(runner, so, None)
    assert runner.speculative_config is SPEC  # restored after the call
    return seen


def test_a_step_without_drafts_is_prepared_as_plain_decoding():
    runner = Runner(AVOptions())
    assert prepare(runner, {}) is None
    assert prepare(runner, {"r0": [5, 6]}) is SPEC
    assert prepare(runner, {}) is None


def test_off_switch_and_other_engines_keep_the_speculative_path():
    # Negative controls: the option off, and vLLM's AV / plain speculation
    # (no options of ours) leave every step on vLLM's speculative path.
    assert prepare(Runner(AVOptions(plain_zero_draft_steps=False)), {}) is SPEC
    assert prepare(Runner(None), {}) is SPEC


def test_recurrent_layers_keep_the_speculative_path():
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(None,))
    assert prepare(Runner(AVOptions(), spec_types=[mamba]), {}) is SPEC


def _uniform_group(*layer_specs):
    """vLLM's wrapper for layers of one type but different page sizes
    (UniformTypeKVCacheSpecs), as it builds for the real Qwen2.5-Coder pair:
    the 0.5B draft's head size (64) differs from the 1.5B target's (128)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    return UniformTypeKVCacheSpecs(
        block_size=16, kv_cache_specs={f"layer.{i}": s for i, s in enumerate(layer_specs)})


def test_layers_of_different_head_sizes_in_one_group_are_still_attention_only():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    target = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=None)
    draft = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=None)
    runner = Runner(AVOptions(), spec_types=[_uniform_group(target, draft)])
    assert prepare(runner, {}) is None
    assert prepare(runner, {"r0": [5]}) is SPEC


def test_a_recurrent_layer_inside_the_wrapper_keeps_the_speculative_path():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=None)
    mamba = MambaSpec(block_size=16, shapes=((4,),), dtypes=(None,))
    runner = Runner(AVOptions(), spec_types=[_uniform_group(attn, mamba)])
    assert prepare(runner, {}) is SPEC


def test_timed_steps_are_filed_as_plain_exactly_when_they_run_plain():
    # Which verification table a timed step corrects (AdaptiveVerifier.
    # observe_verify_time(plain=...)): plain only for a step with no draft
    # that PlainZeroDraftStepPatch prepares as plain decoding.
    def so(drafts):
        return SimpleNamespace(scheduled_spec_decode_tokens=drafts)

    on = Runner(AVOptions())
    assert runs_plain(on, so({}))
    assert runs_plain(on, so({"r0": []}))
    assert not runs_plain(on, so({"r0": [5]}))
    assert not runs_plain(on, SimpleNamespace())  # unknown: speculative
    off = Runner(AVOptions(plain_zero_draft_steps=False))
    assert not runs_plain(off, so({}))  # vLLM's speculative path runs it

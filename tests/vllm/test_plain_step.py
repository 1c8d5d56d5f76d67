"""A step that verifies no draft is prepared as plain decoding
(vllm_av/vllm/mrv1/plain_step.py): the runner's `_prepare_inputs` sees no
speculative config exactly when the step carries no draft, our AV serves
the runner and the model is attention-only."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
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

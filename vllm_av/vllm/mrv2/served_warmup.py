"""Warm the kernels our served steps reach before serving starts (Model
Runner V2).

vLLM 0.32's V2 warm-up (`vllm.v1.worker.gpu.warmup.warmup_kernels`) runs
decode steps with dummy drafts so that Triton compiles the spec-decode
kernels before the first request. Served steps of ours then met kernels it
had not compiled: on the H200 (thirtieth and thirty-first rounds) vLLM's JIT
monitor warned, in every engine of ours and in none of plain V2's, of
`_compute_local_logits_stats_kernel`, `_rejection_kernel`,
`_prepare_prefill_inputs_kernel` and `_resample_kernel` compiled during
serving, a stall of about 200 ms in the step that met them. What its
warm-up leaves out:
- the drafter's step-0 input kernel (`standalone_ar.speculator.
  prepare_prefill_inputs`) has a compile-time block size, the next power
  of two of the step's longest query plus two (capped at 512); the
  warm-up's queries (1, 2, K + 1 and K + 2 tokens) meet 4 and 16, a served
  step any of 4 to 512 (a prompt chunk, a verify trimmed to a few drafts);
- its requests carry every sampling feature (`SamplingParams.
  for_sampler_warmup`: penalties, top-k, top-p, temperature 0.9), so its
  rejection sampler sees logits copied to float32; requests at temperature
  1 or 0 with nothing else need no processing and hand it the model's
  bfloat16 logits, another specialization of the three rejection kernels
  (`target_logits_ptr` typed `*bf16` by the verbose JIT monitor in the
  thirty-third round);
- it runs with adaptive verification off (its costs are not profiled
  yet), so no trimmed (varlen) verify goes through it.

After the cost tables exist (capture) and before the JIT monitor starts,
this runs vLLM's own warm-up steps again with our AV on, once with vLLM's
sampling parameters and once with plain temperature-1 ones, then vLLM's
mixed prefill + decode step once per block size of the drafter's input
kernel, and clears what those steps taught our manager and estimator.
vLLM's mixed step needs two request slots; an engine with one
(`max_num_seqs` 1) gets one request's prompt of the same longest query
instead (`run_prefill_warmup`), so that the drafter's input kernel meets
every block size before serving there too. (One-slot engines of ours
spent 160-350 ms more host time in the batch of their first exploring
step on the H100, thirty-eighth and thirty-ninth rounds; with these
prompt steps still 144-208 ms, fortieth round: that cost was the
selector's recompile at the first step that trimmed drafts, which the
manager's own warm-up now leaves to start-up, `AVManager._warm_admission`.)
Nothing here is served: the requests are vLLM's dummy ones, their KV blocks
are overwritten by the first real requests, and the random seed is reset
as vLLM resets it.
"""

from __future__ import annotations

import contextlib
import logging
import time

from vllm_av.vllm.patching import VllmPatch

logger = logging.getLogger("vllm.vllm_av")

# The drafter's input kernel's block size is min(512, next power of two of
# (longest query + 2)); vLLM's mixed warm-up step has a prefill chunk of
# num_tokens - 1 tokens as its longest query, so 2**k - 2 tokens meet the
# block size 2**k.
DRAFTER_INPUT_BLOCK_CAP = 512
# Request ids of the warm-up's dummy requests: vLLM's warm-up steps', then
# our mixed or prompt steps' (one prefix per size).
DUMMY_REQUEST_PREFIXES = ("_warmup_", "_vllm_av_warm")


def drafter_input_warmup_sizes(max_num_batched_tokens: int, max_model_len: int,
                               vocab_size: int, num_speculative_steps: int) -> list[int]:
    """Token counts of the mixed warm-up steps: one per block-size class of
    the drafter's input kernel from 8 to 512 that a step can reach. vLLM's
    mixed step prompts token ids 0, 1, ..., so its prefill must stay inside
    the vocabulary (a tiny test model's 64 tokens: ids past it index the
    embedding out of range, an illegal memory access on a GPU), and its
    request, with the drafter's lookahead, inside the model's length."""
    sizes = []
    block = 8
    while block <= DRAFTER_INPUT_BLOCK_CAP:
        n = block - 2
        if (n <= max_num_batched_tokens and n - 1 <= vocab_size
                and n + 2 * (num_speculative_steps + 1) <= max_model_len):
            sizes.append(n)
        block *= 2
    return sizes


def run_prefill_warmup(runner, execute_model, sample_tokens, num_tokens: int,
                       req_id: str) -> bool:
    """One dummy request's prompt of `num_tokens` - 1 tokens in one step,
    drafted after at full depth, then finished: the longest query of
    vLLM's mixed step of `num_tokens` (its prefill chunk) with one request
    slot, which that step needs two of. Built as vLLM builds the mixed
    step's first step (its blocks reserved as the scheduler would, the
    KV connector off). Returns whether it ran (False where the KV cache
    cannot hold it)."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.warmup import _warmup_block_counter

    prompt_len = num_tokens - 1
    if runner.is_pooling_model or prompt_len < 2:
        return False
    block_count = _warmup_block_counter(runner)
    counts = [block_count(prompt_len, g.kv_cache_spec)
              for g in runner.kv_cache_config.kv_cache_groups]
    if runner.kv_cache_config.num_blocks <= sum(counts):
        return False
    block_ids, next_id = [], 1  # block 0 is the null block
    for n in counts:
        block_ids.append(list(range(next_id, next_id + n)))
        next_id += n
    token_ids = list(range(prompt_len))
    step = SchedulerOutput.make_empty()
    step.num_spec_tokens_to_schedule = runner.num_speculative_steps
    step.scheduled_new_reqs = [NewRequestData(
        req_id=req_id, prompt_token_ids=token_ids, mm_features=[],
        sampling_params=SamplingParams(max_tokens=2, temperature=0.0, watermarking=False),
        pooling_params=None, block_ids=tuple(block_ids), num_computed_tokens=0,
        lora_request=None, prefill_token_ids=token_ids)]
    step.num_scheduled_tokens = {req_id: prompt_len}
    step.total_num_scheduled_tokens = prompt_len
    finish = SchedulerOutput.make_empty()
    finish.finished_req_ids = {req_id}
    runner.kv_connector.set_disabled(True)
    try:
        execute_model(step)
        sample_tokens(None)
        execute_model(finish)
    finally:
        runner.kv_connector.set_disabled(False)
    return True


def _ours(runner):
    """Our AV manager with its cost tables and option served_kernel_warmup
    on, else None (plain vLLM, vLLM's own AV, the option off)."""
    manager = getattr(runner, "adaptive_verification", None)
    if manager is None or not hasattr(manager, "forget_warmup"):
        return None
    if manager.cost is None or not manager.options.served_kernel_warmup:
        return None
    return manager


@contextlib.contextmanager
def _plain_sampling_params():
    """vLLM's warm-up requests at temperature 1 and nothing else (no logits
    processing: the sampler gets the model's own logits dtype) instead of
    `SamplingParams.for_sampler_warmup`'s every feature."""
    from vllm import SamplingParams

    saved = SamplingParams.__dict__["for_sampler_warmup"]
    SamplingParams.for_sampler_warmup = staticmethod(lambda: SamplingParams(temperature=1.0))
    try:
        yield
    finally:
        SamplingParams.for_sampler_warmup = saved


def _clean_up(runner, execute_model) -> None:
    """Finish every dummy request a failed warm-up step may have left."""
    from vllm.v1.core.sched.output import SchedulerOutput

    out = SchedulerOutput.make_empty()
    out.finished_req_ids = {r for r in runner.req_states.req_id_to_index
                            if r.startswith(DUMMY_REQUEST_PREFIXES)}
    if out.finished_req_ids:
        execute_model(out)
    runner.kv_connector.set_disabled(False)


def warm_served_kernels(worker) -> bool:
    """vLLM's warm-up steps with our AV on, then the drafter's input kernel
    at every block size (vLLM's mixed steps, or with one request slot our
    prompt steps), on a V2 worker whose AV manager is ours. Returns whether
    it ran. A failure is logged and leaves serving as vLLM set it up (those
    kernels then compile when first met)."""
    if not getattr(worker, "use_v2_model_runner", False):
        return False
    if not worker.vllm_config.kernel_config.enable_jit_warmup:
        return False
    runner = worker.model_runner
    manager = _ours(runner)
    if manager is None:
        return False
    import torch
    from vllm.utils.torch_utils import set_random_seed
    from vllm.v1.worker.gpu.warmup import _warmup_kernels, run_mixed_prefill_decode_warmup

    sched = worker.vllm_config.scheduler_config
    sizes = drafter_input_warmup_sizes(
        sched.max_num_batched_tokens, runner.max_model_len,
        worker.vllm_config.model_config.get_vocab_size(), manager.num_speculative_steps)
    # vLLM's mixed step takes two request slots; one slot gets a prompt.
    one_slot = runner.max_num_reqs < 2
    t0 = time.perf_counter()
    ran = []
    try:
        with torch.inference_mode():
            _warmup_kernels(runner, worker.execute_model, worker.sample_tokens)
            with _plain_sampling_params():
                _warmup_kernels(runner, worker.execute_model, worker.sample_tokens)
            for n in sizes:
                req_id = f"{DUMMY_REQUEST_PREFIXES[1]}{n}"
                if one_slot:
                    done = run_prefill_warmup(runner, worker.execute_model,
                                              worker.sample_tokens, n, req_id)
                else:
                    done = run_mixed_prefill_decode_warmup(
                        runner, worker.execute_model, worker.sample_tokens, n,
                        req_id_prefix=req_id)
                if done:
                    ran.append(n)
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()
    except Exception as e:  # noqa: BLE001 - serving must still start
        logger.warning("vllm-av (MRV2): warm-up of the served kernels failed (%s: %s); "
                       "they compile when first met", type(e).__name__, e)
        try:
            _clean_up(runner, worker.execute_model)
        except Exception as cleanup_error:  # noqa: BLE001
            # A device fault is sticky: what failed is reported first, the
            # engine's own next call then reports the device's state.
            logger.warning("vllm-av (MRV2): and its clean-up failed (%s: %s)",
                           type(cleanup_error).__name__, cleanup_error)
        ran = None
    finally:
        with torch.inference_mode():  # the warm-up's steps made inference tensors
            manager.forget_warmup()
        set_random_seed(worker.model_config.seed, worker.parallel_config.data_parallel_index)
    if ran is None:
        return False
    logger.info("vllm-av (MRV2): served kernels warmed in %.2f s (vLLM's warm-up steps with "
                "our AV on, with its sampling parameters and at plain temperature 1; drafter "
                "inputs of %s tokens%s)", time.perf_counter() - t0,
                ", ".join(map(str, ran)) or "no",
                ", one request's prompt each" if one_slot and ran else "")
    return True


class MRV2ServedKernelsWarmupPatch(VllmPatch):
    """Compile the kernels our served steps reach before serving starts.

    Target: vllm.v1.worker.gpu_worker:Worker._maybe_activate_jit_monitor
    Why: vLLM 0.32's V2 warm-up runs with adaptive verification off, with
        queries of 1, 2, K + 1 and K + 2 tokens and with requests whose
        sampling features make the sampler's logits float32; served steps
        of ours (the drafter's input kernel at another block size, a
        temperature-1 batch's bfloat16 logits) compiled
        `_compute_local_logits_stats_kernel`, `_rejection_kernel`,
        `_prepare_prefill_inputs_kernel` and `_resample_kernel` while
        serving, about 200 ms in that step (JIT monitor warnings on the
        H200, thirtieth to thirty-third rounds).
    How: the worker calls this method once, after capture (our cost tables
        built) and before the JIT monitor starts; first, on a V2 worker
        whose AV manager is ours (option served_kernel_warmup, on by
        default), `warm_served_kernels` runs vLLM's `_warmup_kernels` steps
        again with our AV on, twice (vLLM's sampling parameters, then plain
        temperature 1: `SamplingParams.for_sampler_warmup` swapped for the
        call), then vLLM's mixed prefill + decode warm-up step at 6, 14,
        ..., 510 tokens (each block size of the drafter's input kernel;
        with one request slot, one request's prompt of the same longest
        query, `run_prefill_warmup`),
        clears our manager's and estimator's state
        (`AVManager.forget_warmup`) and resets the seed; then vLLM's
        method. Other workers: vLLM's method alone.
    Upstream: warm the rejection kernels for unprocessed (model-dtype)
        logits and with adaptive verification on (after its costs), and the
        drafter's input kernel over its block sizes.
    Remove when: vLLM's V2 warm-up covers all three.
    vLLM: 0.32.0
    """

    target = "vllm.v1.worker.gpu_worker:Worker"
    attributes = ("_maybe_activate_jit_monitor",)
    platforms = ("cuda",)

    def _maybe_activate_jit_monitor(self) -> None:
        warm_served_kernels(self)
        type(self)._orig__maybe_activate_jit_monitor(self)

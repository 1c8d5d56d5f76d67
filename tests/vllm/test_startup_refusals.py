"""Combinations our AV cannot serve are refused when the config is built,
with a message naming the setting to change; no engine is started.

Each case builds the engine config in the test process, as `vllm serve` and
`vllm.LLM` do before any engine process exists:
`EngineArgs(...).create_engine_config()`. That call loads vLLM's general
plugins (ours among them, through the `vllm.general_plugins` entry point);
we call `register()` first anyway, which is idempotent, so the tests do
not depend on the entry point being installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module", autouse=True)
def registered():
    from vllm_av.vllm.plugin import register

    register()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No VLLM_AV_* option from the outer environment; metrics in tmp."""
    for name in list(os.environ):
        if name.startswith("VLLM_AV_") and name != "VLLM_AV_IMPL":
            monkeypatch.delenv(name)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setenv("VLLM_AV_METRICS_DIR", str(tmp_path / "metrics"))


def engine_config(models, spec: dict | None = None, av: bool = True, **kwargs):
    """The VllmConfig of an engine on the tiny target with a draft model."""
    from vllm.engine.arg_utils import EngineArgs

    speculative = {"method": "draft_model", "model": str(models.draft),
                   "num_speculative_tokens": 3}
    if av:
        speculative["enable_adaptive_verification"] = True
    speculative.update(spec or {})
    args = dict(model=str(models.target), dtype="float32", max_model_len=256,
                enforce_eager=True, speculative_config=speculative)
    args.update(kwargs)
    return EngineArgs(**args).create_engine_config()


# ----------------------------------------------------------------- refused


def test_async_scheduling_chooses_the_depth_when_scheduled(tiny_models, monkeypatch):
    """With --async-scheduling the depth is chosen at scheduling time and no
    draft is trimmed (scheduled_depth). VLLM_AV_TEST_CPU_ASYNC lifts the CPU
    platform's override, so the CPU stands in for a GPU here."""
    monkeypatch.setenv("VLLM_AV_TEST_CPU_ASYNC", "1")
    config = engine_config(tiny_models, async_scheduling=True)
    assert config.additional_config["vllm_av"]["scheduled_depth"] is True
    assert config.scheduler_config.async_scheduling is True


@pytest.mark.parametrize("case", ["ngram", "no_adaptive_depth"])
def test_async_scheduling_needs_adaptive_depth_and_a_device_drafter(
    tiny_models, monkeypatch, case
):
    monkeypatch.setenv("VLLM_AV_TEST_CPU_ASYNC", "1")
    spec = None
    if case == "ngram":
        spec = {"method": "ngram", "model": None, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1}
    else:
        monkeypatch.setenv("VLLM_AV_ADAPTIVE_DEPTH", "0")
    with pytest.raises(ValueError, match="--no-async-scheduling"):
        engine_config(tiny_models, spec=spec, async_scheduling=True)


def test_async_scheduling_is_turned_off_on_cpu(tiny_models):
    """The CPU platform never schedules asynchronously (vllm/platforms/cpu.py
    turns it off whatever was asked), so there --async-scheduling is no error."""
    config = engine_config(tiny_models, async_scheduling=True)
    assert "vllm_av" in config.additional_config
    assert config.additional_config["vllm_av"]["scheduled_depth"] is False
    assert config.scheduler_config.async_scheduling is False


def _scheduling_config(asked, method="draft_model", world_size=1, padded=True):
    """The parts of a VllmConfig that choose_scheduling reads."""
    from types import SimpleNamespace

    return SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=asked),
        speculative_config=SimpleNamespace(method=method,
                                           disable_padded_drafter_batch=not padded),
        parallel_config=SimpleNamespace(world_size=world_size),
    )


@pytest.mark.parametrize("case,asked,kwargs,adaptive,on_cpu,expected", [
    ("unset, one GPU, draft model", None, {}, True, False, True),
    ("unset, ngram", None, {"method": "ngram"}, True, False, False),
    ("unset, EAGLE (not measured: on request)", None, {"method": "eagle"}, True, False, False),
    ("asked, EAGLE", True, {"method": "eagle"}, True, False, True),
    ("unset, two workers", None, {"world_size": 2}, True, False, False),
    ("unset, adaptive depth off", None, {}, False, False, False),
    ("unset, unpadded drafter batch", None, {"padded": False}, True, False, False),
    ("unset, CPU", None, {}, True, True, False),
    ("refused", False, {}, True, False, False),
    ("asked", True, {}, True, False, True),
])
def test_scheduling_left_unset_is_async_where_scheduled_depth_serves(
        monkeypatch, case, asked, kwargs, adaptive, on_cpu, expected):
    """Left unset, the scheduling is async (scheduled depth) on a GPU with
    one worker process, a draft model and adaptive depth, as vLLM's own
    default for draft models; synchronous wherever scheduled depth would not
    serve in full or was not measured (EAGLE/MTP: on request). Asked for or
    refused, the user's choice holds, and the config carries the outcome."""
    from vllm.platforms import current_platform

    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.config_patch import choose_scheduling

    monkeypatch.setattr(current_platform, "is_cpu", lambda: on_cpu)
    config = _scheduling_config(asked, **kwargs)
    assert choose_scheduling(config, AVOptions(adaptive_depth=adaptive)) is expected, case
    assert config.scheduler_config.async_scheduling is expected, case


def test_async_scheduling_asked_with_ngram_on_gpu_is_refused(monkeypatch):
    from vllm.platforms import current_platform

    from vllm_av.vllm.config import AVOptions
    from vllm_av.vllm.config_patch import choose_scheduling

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    with pytest.raises(ValueError, match="--no-async-scheduling"):
        choose_scheduling(_scheduling_config(True, method="ngram"), AVOptions())


@pytest.mark.parametrize("method", ["medusa", "ngram_gpu"])
def test_unsupported_method_is_refused(tiny_models, method):
    spec = {"method": method}
    if method == "ngram_gpu":
        spec = {"method": method, "model": None, "prompt_lookup_max": 3}
    with pytest.raises(ValueError, match=rf"speculative_config\.method='{method}'") as e:
        engine_config(tiny_models, spec)
    assert "vllm-av" in str(e.value)


def test_lora_is_refused(tiny_models):
    with pytest.raises(ValueError, match="--enable-lora"):
        engine_config(tiny_models, enable_lora=True)


def test_pipeline_parallelism_is_refused(tiny_models):
    with pytest.raises(ValueError, match="--pipeline-parallel-size 1"):
        engine_config(tiny_models, pipeline_parallel_size=2)


def test_local_argmax_reduction_is_refused(tiny_models):
    # vLLM's own SpeculativeConfig check answers first; ours is behind it.
    with pytest.raises(ValueError, match="use_local_argmax_reduction"):
        engine_config(tiny_models, {"use_local_argmax_reduction": True})


@pytest.mark.parametrize("switch, why", [(None, "needs CUDA"), ("1", "needs CUDA"),
                                         ("0", "VLLM_AV_MRV2=0")])
def test_model_runner_v2_is_refused(tiny_models, monkeypatch, switch, why):
    # On the CPU our V2 path never serves, switched on (the default) or not.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    if switch is None:
        monkeypatch.delenv("VLLM_AV_MRV2", raising=False)
    else:
        monkeypatch.setenv("VLLM_AV_MRV2", switch)
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=0") as e:
        engine_config(tiny_models)
    assert why in str(e.value)
    assert "VLLM_AV_IMPL=vllm" in str(e.value) and "VLLM_AV_MRV2=1" in str(e.value)


def test_model_runner_v2_patches_are_on_unless_switched_off():
    from vllm_av.vllm.mrv2.patches import MRV2_PATCHES
    from vllm_av.vllm.plugin import all_patches, runner_patches

    def v2(env):
        return [p for p in runner_patches(all_patches(), env) if p in MRV2_PATCHES]

    assert v2({}) == list(MRV2_PATCHES)
    assert v2({"VLLM_AV_MRV2": "1"}) == list(MRV2_PATCHES)
    assert v2({"VLLM_AV_MRV2": "0"}) == []
    assert v2({"VLLM_AV_MRV2": "1", "VLLM_USE_V2_MODEL_RUNNER": "0"}) == []
    with pytest.raises(ValueError, match="VLLM_AV_MRV2"):
        v2({"VLLM_AV_MRV2": "perhaps"})


@pytest.mark.parametrize(
    "name, value",
    [
        ("VLLM_AV_REFIT_INTERVAL", "0"),
        ("VLLM_AV_REFIT_INTERVAL", "abc"),
        ("VLLM_AV_METRICS_INTERVAL", "-1"),
        ("VLLM_AV_PROFILE_REPEATS", "1.5"),
        # A typo must not silently turn a switch off.
        ("VLLM_AV_ADAPTIVE_DEPTH", "ture"),
        ("VLLM_AV_TEST_FIXED_DEPTH", "-2"),
        # A V2 measurement control is refused where V1 serves the flag.
        ("VLLM_AV_TEST_FIXED_DEPTH", "0"),
    ],
)
def test_invalid_option_env_is_refused(tiny_models, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        engine_config(tiny_models)


def test_invalid_impl_is_refused(monkeypatch):
    from vllm_av.vllm.config import selected_impl

    monkeypatch.setenv("VLLM_AV_IMPL", "bogus")
    with pytest.raises(ValueError, match=r"VLLM_AV_IMPL='bogus' is not one of ours, vllm, off"):
        selected_impl()
    for ok in ("ours", "vllm", "off", " OFF ", ""):
        monkeypatch.setenv("VLLM_AV_IMPL", ok)
        assert selected_impl() == (ok.strip().lower() or "ours")


def test_invalid_impl_stops_vllm_plugin_loading(tmp_path):
    """In a fresh process (registration happens once per process), vLLM's
    own plugin loader fails on VLLM_AV_IMPL=bogus with our message."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["VLLM_AV_IMPL"] = "bogus"
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "import vllm_av.vllm.plugin as p\n"
        "try:\n"
        "    load_general_plugins()\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e); raise SystemExit(3)\n"
        # Entry point not installed: call the plugin as vLLM would.
        "p.register()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "VLLM_AV_IMPL='bogus' is not one of ours, vllm, off" in out, out


# ----------------------------------------------------------------- accepted


def test_supported_config_is_routed_to_vllm_av(tiny_models, monkeypatch, tmp_path):
    from vllm_av.vllm.config import AVOptions, av_options_of

    monkeypatch.setenv("VLLM_AV_REFIT_INTERVAL", "4")
    monkeypatch.setenv("VLLM_AV_ADAPTIVE_DEPTH", "off")
    config = engine_config(tiny_models, additional_config={"user_key": 1})
    extra = config.additional_config
    assert extra["user_key"] == 1  # the user's entries survive
    options = extra["vllm_av"]
    assert options == AVOptions(
        refit_interval=4, adaptive_depth=False, metrics_dir=str(tmp_path / "metrics")
    ).to_dict()
    assert av_options_of(config) == AVOptions.from_dict(options)
    # vLLM's own AV machinery stays off; scheduling is synchronous.
    assert config.speculative_config.enable_adaptive_verification is False
    assert config.speculative_config.method == "draft_model"
    assert config.scheduler_config.async_scheduling is False
    assert not config.use_v2_model_runner


def test_ngram_config_is_routed_to_vllm_av(tiny_models):
    config = engine_config(
        tiny_models,
        {"method": "ngram", "model": None, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    )
    assert "vllm_av" in config.additional_config
    assert config.speculative_config.enable_adaptive_verification is False


def test_config_without_av_is_left_alone(tiny_models):
    config = engine_config(tiny_models, av=False)
    assert "vllm_av" not in (config.additional_config or {})
    assert config.speculative_config.enable_adaptive_verification is False


@pytest.fixture
def v2_by_default(monkeypatch):
    """Model Runner V2 as vLLM picks it on a GPU (unless the environment
    names V1); the variable our start-up may set is restored afterwards."""
    from vllm.config.vllm import VllmConfig

    monkeypatch.setattr(VllmConfig, "use_v2_model_runner", property(
        lambda self: os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"))
    yield
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def test_enforce_eager_serves_our_av_on_model_runner_v1(tiny_models, v2_by_default):
    # V2 would refuse AV without FULL graphs; our V1 path serves it eagerly.
    config = engine_config(tiny_models, enforce_eager=True)
    assert os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0"
    assert not config.use_v2_model_runner
    assert "vllm_av" in config.additional_config
    assert config.speculative_config.enable_adaptive_verification is False


def test_a_runner_named_in_the_environment_is_kept_with_enforce_eager(tiny_models, monkeypatch,
                                                                      v2_by_default):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    # V2 kept: here (no CUDA) our V2 path refuses it, as it would without eager.
    with pytest.raises(ValueError, match="needs CUDA"):
        engine_config(tiny_models, enforce_eager=True)
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_graphs_keep_model_runner_v2():
    from types import SimpleNamespace

    from vllm_av.vllm.config_patch import prefer_v1_when_eager

    config = SimpleNamespace(model_config=SimpleNamespace(enforce_eager=False),
                             use_v2_model_runner=True)
    prefer_v1_when_eager(config)
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ

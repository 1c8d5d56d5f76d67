"""Our metrics directory stays out of vLLM's config hash
(ConfigHashWithoutMetricsDirPatch, vllm_av/vllm/config_patch.py).

vLLM 0.32 keys its torch.compile caches by `VllmConfig.compute_hash`, which
hashes `additional_config` whole. Our options ride there, and their
`metrics_dir` is a fresh temporary directory for each server unless one is
named, so without the patch no start of ours found the compiled code of the
last. Real VllmConfig objects (no model) are hashed here.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm_av.vllm.config import ADDITIONAL_CONFIG_KEY, AVOptions  # noqa: E402
from vllm_av.vllm.config_patch import (  # noqa: E402
    ConfigHashWithoutMetricsDirPatch,
    without_metrics_dir,
)
from vllm_av.vllm.patching import applied_patches, apply_patch, revert_patch  # noqa: E402


def config(metrics_dir: str, **options):
    from vllm.config import VllmConfig

    ours = AVOptions(metrics_dir=metrics_dir, **options).to_dict()
    return VllmConfig(additional_config={ADDITIONAL_CONFIG_KEY: ours, "other": 1})


@pytest.fixture
def patched():
    already = ConfigHashWithoutMetricsDirPatch.__name__ in applied_patches()
    apply_patch(ConfigHashWithoutMetricsDirPatch)
    try:
        yield
    finally:
        if not already:  # the plugin's own application stays for other tests
            revert_patch(ConfigHashWithoutMetricsDirPatch)


def test_servers_differing_only_in_metrics_dir_share_the_hash(patched):
    a, b = config("/tmp/vllm-av-metrics-a"), config("/tmp/vllm-av-metrics-b")
    assert a.compute_hash() == b.compute_hash()


def test_every_other_option_still_changes_the_hash(patched):
    a = config("/tmp/m", refit_interval=4)
    assert a.compute_hash() != config("/tmp/m", refit_interval=8).compute_hash()
    # ... and so does the rest of additional_config.
    c = config("/tmp/m", refit_interval=4)
    c.additional_config["other"] = 2
    assert a.compute_hash() != c.compute_hash()


def test_the_config_itself_keeps_its_metrics_dir(patched):
    a = config("/tmp/vllm-av-metrics-a")
    a.compute_hash()
    assert a.additional_config[ADDITIONAL_CONFIG_KEY]["metrics_dir"] == "/tmp/vllm-av-metrics-a"
    assert a.additional_config["other"] == 1


def test_negative_control_vllms_own_hash_differs_by_metrics_dir():
    from vllm.config import VllmConfig

    orig = getattr(VllmConfig, "_orig_compute_hash", VllmConfig.compute_hash)
    a, b = config("/tmp/vllm-av-metrics-a"), config("/tmp/vllm-av-metrics-b")
    assert orig(a) != orig(b)


def test_without_metrics_dir_leaves_other_configs_alone():
    plain = {"other": 1}
    assert without_metrics_dir(plain) is plain
    assert without_metrics_dir(None) is None
    ours = {ADDITIONAL_CONFIG_KEY: {"metrics_dir": "/x", "k": 1}}
    assert without_metrics_dir(ours) == {ADDITIONAL_CONFIG_KEY: {"k": 1}}
    assert ours[ADDITIONAL_CONFIG_KEY]["metrics_dir"] == "/x"

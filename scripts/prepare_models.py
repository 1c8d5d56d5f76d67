#!/usr/bin/env python3
"""Prepare the benchmark model pair and prompt sets; same as ``python -m vllm_av.models``.

Works from a checkout without installing the package. See
``vllm_av/models/__main__.py`` for the flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_av.models.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

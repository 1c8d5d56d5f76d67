"""Make vllm-av visible to vLLM on a machine where it cannot be pip-installed.

The GPU machine has no network and its python has no build backend we can
count on, so instead of `pip install` we write a metadata-only dist-info
with our `vllm.general_plugins` entry point into a directory on PYTHONPATH;
the package itself is imported from the checkout (also on PYTHONPATH).

    python3 scripts/gpu/register_plugin.py /tmp/site_av
"""

import pathlib
import sys

VERSION = "0.1.0"


def main(target: str) -> None:
    info = pathlib.Path(target) / f"vllm_av-{VERSION}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-av\nVersion: {VERSION}\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nvllm_av = vllm_av.vllm.plugin:register\n"
    )
    (info / "RECORD").write_text("")
    print(f"registered vllm-av plugin in {info}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/site_av")

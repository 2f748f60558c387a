"""Write GSM8K in SkyRL's schema: ``train.parquet`` and ``validation.parquet``.

Each row: ``data_source``, ``prompt`` (one user message), ``env_class="gsm8k"``, ``reward_spec``
(``{method: "rule", ground_truth}``) and ``extra_info``. SkyRL passes every column except ``prompt``
and ``env_class`` to the environment, whose ``GSM8kEnv`` reads ``reward_spec.ground_truth``.
(verl's GSM8K files share the names but use ``reward_model`` instead; SkyRL would score them all 0.)

Usage:
    python examples/skyrl/prepare_gsm8k.py --output-dir ~/data/gsm8k-skyrl                  # from the Hub (datasets)
    python examples/skyrl/prepare_gsm8k.py --output-dir ~/data/gsm8k-skyrl --jsonl-dir DIR  # DIR/{train,test}.jsonl
The JSONL files hold GSM8K's own rows: ``{"question": ..., "answer": "... #### 42"}``; GSM8K's test
split becomes ``validation.parquet``. The verl example's script takes the same flags.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Think step by step, then write the final answer as a number after "####".'
_ANSWER = re.compile(r"####\s*(-?[0-9.,$]+)")


def ground_truth(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer, without commas or ``$`` (what GSM8kEnv compares)."""
    found = _ANSWER.search(answer)
    if found is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return found.group(1).replace(",", "").replace("$", "")


def to_skyrl_rows(records: Iterable[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """GSM8K ``{question, answer}`` records → SkyRL rows."""
    rows = []
    for index, record in enumerate(records):
        question, answer = record["question"], record["answer"]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "env_class": "gsm8k",
                "reward_spec": {"method": "rule", "ground_truth": ground_truth(answer)},
                "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
            }
        )
    return rows


def load_split(split: str, jsonl_dir: Path | None) -> list[dict[str, Any]] | None:
    """GSM8K's ``split`` rows from ``jsonl_dir/<split>.jsonl`` (None when that file is absent), else the Hub."""
    if jsonl_dir is not None:
        path = jsonl_dir.expanduser() / f"{split}.jsonl"
        if not path.is_file():
            return None
        with path.open() as handle:
            return [json.loads(line) for line in handle if line.strip()]
    try:
        import datasets
    except ImportError:
        raise SystemExit(
            "downloading GSM8K needs the `datasets` package (pip install datasets); or pass --jsonl-dir"
        ) from None
    return list(datasets.load_dataset(DATA_SOURCE, "main", split=split))


def write_parquet(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-dir", type=Path, default=Path("~/data/gsm8k-skyrl"), help="where the parquet files go"
    )
    parser.add_argument("--jsonl-dir", type=Path, help="read {train,test}.jsonl from here instead of the Hub")
    parser.add_argument("--limit", type=int, default=0, help="keep only the first N rows per split; 0 = all")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    output = args.output_dir.expanduser()
    written = 0
    for split, name in (("train", "train"), ("test", "validation")):
        records = load_split(split, args.jsonl_dir)
        if records is None:
            continue
        rows = to_skyrl_rows(records[: args.limit or None], split=split)
        write_parquet(rows, output / f"{name}.parquet")
        print(f"wrote {len(rows)} rows to {output / f'{name}.parquet'}")
        written += 1
    if not written:
        raise SystemExit(f"--jsonl-dir {args.jsonl_dir} holds neither train.jsonl nor test.jsonl")


if __name__ == "__main__":
    main()

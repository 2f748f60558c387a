"""Verifiable tasks for the GRPO recipe: synthetic arithmetic, and GSM8K from a local JSONL file.

A task hands out :class:`Problem` s (a prompt string and the exact answer string) and scores a
completion with :func:`exact_match_reward`. The arithmetic task is what ``icefloe demo`` trains:
``"7+5="`` → ``"12"`` then EOS. Answers have one or two digits, so responses differ in length and
the loss mask is exercised.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from icefloe.protocol import ConfigError

__all__ = [
    "ArithmeticTask",
    "Problem",
    "exact_match_reward",
    "gsm8k_answer",
    "load_gsm8k",
    "numeric_match_reward",
]


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer string a correct completion spells out (EOS not included)."""

    prompt: str
    answer: str


def exact_match_reward(text: str, finish_reason: str, answer: str) -> float:
    """1.0 when the completion is exactly ``answer`` and ended by choosing EOS, else 0.0.

    ``text`` is the decoded completion without special tokens; ``finish_reason == "stop"`` means
    the model stopped by itself, so running out of ``max_tokens`` after the right digits scores 0.
    """
    return 1.0 if finish_reason == "stop" and text == answer else 0.0


class ArithmeticTask:
    """Addition problems ``"a+b="`` with operands drawn uniformly from ``0..max_operand``.

    Args:
        seed: the only source of randomness; the same seed gives the same problems in the same order.
        max_operand: largest operand; 9 gives 100 distinct problems with 1- and 2-digit answers.
    """

    def __init__(self, seed: int, *, max_operand: int = 9) -> None:
        if max_operand < 1:
            raise ConfigError(f"task.max_operand must be >= 1; got {max_operand}")
        self.max_operand = max_operand
        self._rng = random.Random(seed)

    def sample(self, num_problems: int) -> list[Problem]:
        """Draw ``num_problems`` problems from the task's own random stream, without replacement.

        Each pass deals every distinct problem once in a fresh random order, so a draw of
        ``len(all_problems())`` holds each problem exactly once, and a rare answer (``0+0=0``) comes
        up as often as any other.
        """
        problems: list[Problem] = []
        while len(problems) < num_problems:
            deck = self.all_problems()
            self._rng.shuffle(deck)
            problems += deck[: num_problems - len(problems)]
        return problems

    def all_problems(self) -> list[Problem]:
        """Every distinct problem, for evaluation."""
        span = range(self.max_operand + 1)
        return [self.problem(a, b) for a in span for b in span]

    @staticmethod
    def problem(a: int, b: int) -> Problem:
        return Problem(prompt=f"{a}+{b}=", answer=str(a + b))

    @staticmethod
    def reward(text: str, finish_reason: str, problem: Problem) -> float:
        return exact_match_reward(text, finish_reason, problem.answer)


# --- GSM8K (for real models; the tiny presets cannot read words) --------------------------------
_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*\.?\d*")


def gsm8k_answer(solution: str) -> str:
    """The final number of a GSM8K solution (the text after ``####``), commas removed.

    Raises:
        ValueError: the solution has no ``#### <number>`` line.
    """
    found = _GSM8K_FINAL.search(solution)
    if found is None:
        raise ValueError(f"a GSM8K answer must end with '#### <number>'; got {solution[-80:]!r}")
    return found.group(1).replace(",", "")


def load_gsm8k(path: Path | str, *, limit: int | None = None) -> list[Problem]:
    """Read GSM8K rows ``{"question", "answer"}`` from a local JSONL file into problems.

    Raises:
        ConfigError: the file is missing, or a line is not JSON with both fields (line number given).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task.path {str(path)!r} does not exist; give a local GSM8K JSONL file")
    problems: list[Problem] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                problems.append(
                    Problem(prompt=f"Question: {row['question']}\nAnswer:", answer=gsm8k_answer(row["answer"]))
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{number} is not a GSM8K row with 'question' and 'answer': {exc}") from None
            if limit is not None and len(problems) >= limit:
                break
    return problems


def numeric_match_reward(text: str, finish_reason: str, answer: str) -> float:
    """1.0 when the last number in ``text`` equals ``answer`` numerically (GSM8K scoring), else 0.0."""
    del finish_reason  # a long solution may be cut by max_tokens after its answer; still count it
    numbers: Sequence[str] = _NUMBER.findall(text)
    if not numbers:
        return 0.0
    try:
        return 1.0 if float(numbers[-1].replace(",", "").rstrip(".")) == float(answer) else 0.0
    except ValueError:
        return 0.0

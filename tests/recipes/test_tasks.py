"""The arithmetic task, its reward, and the GSM8K reader."""

from __future__ import annotations

import json

import pytest

from icefloe.protocol import ConfigError
from icefloe.recipes.tasks import (
    ArithmeticTask,
    Problem,
    exact_match_reward,
    gsm8k_answer,
    load_gsm8k,
    numeric_match_reward,
)


def test_arithmetic_task_same_seed_gives_same_problems():
    assert ArithmeticTask(7).sample(50) == ArithmeticTask(7).sample(50)
    assert ArithmeticTask(7).sample(50) != ArithmeticTask(8).sample(50)


def test_arithmetic_task_answers_are_sums_of_one_or_two_digits():
    problems = ArithmeticTask(0).sample(400)
    for problem in problems:
        a, b = problem.prompt.removesuffix("=").split("+")
        assert problem.answer == str(int(a) + int(b))
        assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
    assert {len(p.answer) for p in problems} == {1, 2}  # responses differ in length


def test_arithmetic_task_all_problems_covers_the_table():
    problems = ArithmeticTask(0, max_operand=3).all_problems()
    assert len(problems) == 16 == len(set(problems))
    assert Problem("3+3=", "6") in problems


def test_arithmetic_task_rejects_a_bad_operand_range():
    with pytest.raises(ConfigError, match=r"task\.max_operand must be >= 1; got 0"):
        ArithmeticTask(0, max_operand=0)


@pytest.mark.parametrize(
    ("text", "finish_reason", "expected"),
    [("12", "stop", 1.0), ("12", "length", 0.0), ("1", "stop", 0.0), ("123", "stop", 0.0), (" 12", "stop", 0.0)],
)
def test_exact_match_reward_needs_the_answer_and_eos(text, finish_reason, expected):
    assert exact_match_reward(text, finish_reason, "12") == expected
    assert ArithmeticTask.reward(text, finish_reason, Problem("5+7=", "12")) == expected


def test_gsm8k_answer_reads_the_final_number():
    assert gsm8k_answer("She sells 3 * 2 = <<3*2=6>>6 eggs.\n#### 1,260") == "1260"
    assert gsm8k_answer("#### -4.5") == "-4.5"
    with pytest.raises(ValueError, match="must end with '#### <number>'"):
        gsm8k_answer("no final line")


def test_load_gsm8k_reads_rows_and_honours_limit(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": f"What is {i} plus 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    problems = load_gsm8k(path)
    assert [p.answer for p in problems] == ["1", "2", "3"]
    assert problems[0].prompt.startswith("Question: What is 0 plus 1?")
    assert len(load_gsm8k(path, limit=2)) == 2


def test_load_gsm8k_names_the_bad_line(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n" + '{"question": "q"}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"gsm8k.jsonl:2 is not a GSM8K row"):
        load_gsm8k(path)
    with pytest.raises(ConfigError, match="does not exist"):
        load_gsm8k(tmp_path / "missing.jsonl")


def test_numeric_match_reward_compares_the_last_number():
    assert numeric_match_reward("so 3 + 4 = 7.", "stop", "7") == 1.0
    assert numeric_match_reward("it is 1,260", "length", "1260") == 1.0
    assert numeric_match_reward("7 or 8", "stop", "7") == 0.0
    assert numeric_match_reward("no idea", "stop", "7") == 0.0

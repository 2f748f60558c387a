"""The docs name only what exists: every ``icefloe`` command and flag, every flag of the scripts in
``examples/`` and ``bench/``, every icefloe environment variable and every repository file they cite.

Commands and flags are checked against the CLI's own parser (typer's click command tree), script
flags against the scripts' ``add_argument`` calls, and environment variables (``ICEFLOE_*``,
``ARCTIC_*``, ``CORTEX_*``; other tools' variables are theirs to document) against the package's
source.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer

from bench import RESULTS, summary_fields
from icefloe.cli import app

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*/README.md")])
SCRIPTS = {p.relative_to(ROOT).as_posix(): p for p in sorted([*ROOT.glob("examples/*/*.py"), *ROOT.glob("bench/*.py")])}

_ICEFLOE = re.compile(r"(?<![\w.\-/'\"\[=<])icefloe(?![\w.\-\[/])")
_FLAG = re.compile(r"(?<![\w-])--?[a-zA-Z][\w-]*")
_ENV = re.compile(r"\b(?:ICEFLOE|ARCTIC|CORTEX)_[A-Z0-9_]*")
_FILE = re.compile(r"^\w[\w./{},-]*\.(?:md|py|yaml|json|sh)$")


def code_pieces(text: str) -> Iterator[str]:
    """Inline code spans (one may wrap a line), and the commands of fenced blocks: lines joined
    where they end in a backslash, without ``#`` comments."""
    prose: list[str] = []
    fenced, command = False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            command += re.split(r"(?:^|\s)#", line, maxsplit=1)[0].replace("`", " ")
            if command.rstrip().endswith("\\"):
                command = command.rstrip()[:-1] + " "
                continue
            yield command
            command = ""
        else:
            prose.append(line)
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        yield " ".join(span.split())


def options(command: Any) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts) if name.startswith("-")}


def all_cli_options(command: Any) -> set[str]:
    found = options(command)
    for sub in getattr(command, "commands", {}).values():
        found |= all_cli_options(sub)
    return found


def check_command(tokens: list[str], root: Any) -> list[str]:
    """Problems with one ``icefloe ...`` mention: unknown (sub)commands and flags. ``a | b`` (or
    ``a \\| b`` in a table) names alternatives at one level; words after a command are its arguments."""
    path: list[Any] = [root]
    alternative = False
    problems = []
    for raw in tokens:
        token = raw.strip("[](),;:")
        if not token:
            continue
        if token in ("|", "\\|"):
            alternative = True
            continue
        if token.startswith("-"):
            name = token.split("=", 1)[0]
            if name not in options(path[-1]):
                problems.append(f"{' '.join(c.name or 'icefloe' for c in path)} has no option {name}")
            continue
        if alternative and len(path) > 1:
            path.pop()
        alternative = False
        commands = getattr(path[-1], "commands", None)
        if commands is None:
            continue  # an argument or an option's value
        sub = commands.get(token)
        if sub is None:
            problems.append(f"{' '.join(c.name or 'icefloe' for c in path)} has no command {token!r}")
            break
        path.append(sub)
    return problems


def script_options(path: Path) -> set[str]:
    """The flags a script declares with ``parser.add_argument("--flag", ...)``."""
    calls = re.findall(r"add_argument\(([^)]*)\)", path.read_text(encoding="utf-8"))
    return {flag for call in calls for flag in re.findall(r"[\"'](--?[\w-]+)[\"']", call)}


def doc_problems(text: str, root: Any, package_source: str) -> list[str]:
    """Everything ``text`` names that does not exist, one line each."""
    known_options = all_cli_options(root).union(*(script_options(path) for path in SCRIPTS.values()))
    problems = []
    for piece in code_pieces(text):
        script = next((name for name in SCRIPTS if name in piece or Path(name).name in piece.split()[:1]), None)
        mention = _ICEFLOE.search(piece)
        if script is not None:
            known = script_options(SCRIPTS[script])
            problems += [f"{script} has no option {f}" for f in _FLAG.findall(piece) if f.split("=")[0] not in known]
        elif mention is not None:
            problems += check_command(piece[mention.end() :].split(), root)
        elif not re.search(r"\b(?:pip|python3?|torchrun|bash|git|curl)\b", piece):
            unknown = [f for f in _FLAG.findall(piece) if f.startswith("--") and f not in known_options]
            problems += [f"no option {f} anywhere" for f in unknown]
        if _FILE.match(piece.strip()) and "/" in piece and "{" not in piece and not _repo_has(piece.strip()):
            problems.append(f"no file {piece.strip()} in the repository")
    for name in sorted(set(_ENV.findall(text))):
        if name not in package_source:
            problems.append(f"no environment variable {name} in the package")
    return problems


def _repo_has(path: str) -> bool:
    """Whether a cited path names a repository file, relative to the root or to any folder in it."""
    return (ROOT / path).exists() or any(ROOT.glob(f"**/{path}"))


@pytest.fixture(scope="module")
def root() -> Any:
    return typer.main.get_command(app)


@pytest.fixture(scope="module")
def package_source() -> str:
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted((ROOT / "icefloe").rglob("*.py")))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_names_only_what_exists(doc, root, package_source):
    assert doc_problems(doc.read_text(encoding="utf-8"), root, package_source) == []


def test_doc_check_catches_what_does_not_exist(root, package_source):
    """The check can fail: a made-up command, flag, script flag, variable and file are each reported."""
    text = "\n".join(
        [
            "Run `icefloe serve --no-such-flag` or `icefloe run`, then `icefloe jobs list \\| frobnicate`.",
            "```bash",
            "python examples/verl/prepare_gsm8k.py --out ~/data  # an old flag",
            "ICEFLOE_NO_SUCH_VAR=1 icefloe demo --steps 3",
            "```",
            "See `reference/no-such-file.md` and `--made-up`.",
        ]
    )
    assert sorted(doc_problems(text, root, package_source)) == sorted(
        [
            "icefloe serve has no option --no-such-flag",
            "icefloe has no command 'run'",
            "icefloe jobs has no command 'frobnicate'",
            "examples/verl/prepare_gsm8k.py has no option --out",
            "no option --made-up anywhere",
            "no file reference/no-such-file.md in the repository",
            "no environment variable ICEFLOE_NO_SUCH_VAR in the package",
        ]
    )


# --- numbers -----------------------------------------------------------------------------------
# A number a doc reports as a result (a reward, a time, a speed-up, a share of bytes) is a promise, so
# each one is tied here to the test or bench that reproduces it: (doc, the words that state it, the
# reproducer, "path::test" or a bench script, whose figure BENCH_NUMBERS then checks). Settings and
# limits (a default of 600 s, a 60 MiB cap) are not results: the code that enforces them is their source.
CLAIMS = [
    ("README.md", "from about 0.0 to 1.0", "tests/recipes/test_readme_loop.py::test_the_readme_loop_learns"),
    ("README.md", "the reward starts near 0.5", "tests/recipes/test_grpo.py::test_demo_run_learns_addition"),
    ("README.md", "Seeds 0-9 end between 0.96 and 1.00",
     "tests/recipes/test_grpo.py::test_every_recorded_full_run_ends_above_the_readmes_floor"),
    ("docs/lora.md", "the first RL step scores 0.56, the last ten 0.99",
     "tests/recipes/test_grpo.py::test_demo_run_with_lora_learns_addition"),
    ("docs/lora.md", "moves 3.4% of the full weights", "bench/bench_lora.py"),
    ("docs/lora.md", "the gradients and AdamW state take 3.4%", "bench/bench_lora.py"),
    ("docs/architecture.md", "peaks at 1.17× the engine RSS", "bench/bench_memory.py"),
    ("docs/architecture.md", "computes 1.007 positions", "bench/bench_memory.py"),
    ("docs/architecture.md", "costs 3.55× the engine CPU seconds", "bench/bench_memory.py"),
    ("docs/ray.md", "(a ~0.5 GB state)", "bench/bench_ray.py"),
    ("docs/architecture.md", "under 2 GB of engine RSS",
     "tests/service/test_tinker_memory.py::test_guess_number_sized_forward_backward_keeps_the_engine_under_2_gb"),
    ("docs/service.md", "4 ×", "bench/bench_remote.py"),
    ("docs/service.md", "for 8 s", "bench/bench_load.py"),
    ("docs/tinker.md", "runs 16 SDK clients", "bench/bench_load.py"),
    ("docs/service.md", "take 0.15 of the memory", "bench/bench_multilora.py"),
]  # fmt: skip

_NUMBER = r"\d+(?:\.\d+)?"
_MEASURE = re.compile(
    rf"(?<![\w.-])~?{_NUMBER}(?:\s*(?:to|-|–)\s*{_NUMBER})?\s*(?:ms|µs|s|min|minutes?|seconds?|%|×|GB|ops/s)(?!\w)"
    rf"|(?<![\w.-])[01]\.\d\d?(?![\w.])|\b(?:under|about|in) (?:a|one|two) minutes?\b"
)
_REPORTS = re.compile(
    r"~|\b(?:about|took|takes|costs?|measured|one run|p50|p99|faster|slower|ends? (?:at|above|near)|reward|"
    r"scores \d|gave|ranged|overhead|per step)\b",
    re.IGNORECASE,
)


def number_claims(text: str) -> list[str]:
    """The sentences of ``text``'s prose (code left out) that state a measured number."""
    prose, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            prose.append(re.sub(r"`[^`]*`", "", line))
    # paragraphs, table rows and list items, then their sentences
    pieces = re.split(r"\n\s*\n|\n(?=\s*(?:[-*] |\|))|(?<=\|)\n", "\n".join(prose))
    sentences = [s for piece in pieces for s in re.split(r"(?<=[.;])\s+(?=[A-Z(])", piece)]
    return [" ".join(s.split()) for s in sentences if _MEASURE.search(s) and _REPORTS.search(s)]


def uncovered(doc: str, text: str, claims: list[tuple[str, str, str]]) -> list[str]:
    """Each sentence of ``doc`` stating a number that no claim of it covers, and each claim whose words
    the doc no longer holds."""
    own = [words for name, words, _ in claims if name == doc]
    problems = [f"{doc}: no reproducer for: {s}" for s in number_claims(text) if not any(w in s for w in own)]
    flat = " ".join(re.sub(r"`[^`]*`", "", text).split())
    return problems + [f"{doc}: the claim {words!r} is gone from the doc" for words in own if words not in flat]


@pytest.mark.parametrize("doc", [d for d in DOCS if d.parent in (ROOT, ROOT / "docs")], ids=lambda p: p.name)
def test_every_number_a_doc_reports_has_a_test_or_bench_that_reproduces_it(doc):
    assert uncovered(doc.relative_to(ROOT).as_posix(), doc.read_text(encoding="utf-8"), CLAIMS) == []


@pytest.mark.parametrize(("doc", "words", "reproducer"), CLAIMS)
def test_each_reproducer_exists(doc, words, reproducer):
    path, _, test = reproducer.partition("::")
    assert (ROOT / path).is_file(), reproducer
    assert not test or re.search(rf"^def {test}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), reproducer
    if path.startswith("bench/"):  # a bench reproduces what it prints: the claim says which figure
        name = Path(path).stem.removeprefix("bench_")
        assert any(
            (d, w) == (doc, words) and source.split()[-1].split("-")[0] == name for d, w, source, *_ in BENCH_NUMBERS
        ), f"{doc}: {words!r} names {path} but no figure of it in BENCH_NUMBERS"


# Each number a doc ties to a bench, reproduced from what the bench prints: ``smoke <name>``, its
# ``--smoke`` run, where the figure does not depend on the sizes (a ratio of byte counts); else
# ``recorded <name>``, the summary line its last full run with ``--record`` wrote to
# ``bench/results/<name>.txt`` (committed; rerun it and commit the file when the bench changes).
# (doc, the claim's words, the source, the key, the factor from the key's value to the words' unit):
# the words' first number must equal the value times the factor, to the digits the words show, or
# within a quarter of it where the words say "about" or "~".
BENCH_NUMBERS = [
    ("docs/lora.md", "moves 3.4% of the full weights", "smoke lora", "ratio", 100),
    ("docs/lora.md", "the gradients and AdamW state take 3.4%", "smoke lora", "state_ratio", 100),
    ("docs/architecture.md", "peaks at 1.17× the engine RSS", "recorded memory", "peak_ratio", 1),
    ("docs/architecture.md", "computes 1.007 positions", "recorded memory", "padding_ratio", 1),
    ("docs/architecture.md", "costs 3.55× the engine CPU seconds", "recorded memory", "speedup", 1),
    ("docs/ray.md", "(a ~0.5 GB state)", "recorded ray", "sync_bytes", 1e-9),
    ("docs/service.md", "of 800 samples", "recorded remote", "samples_per_step", 1),
    ("docs/service.md", "4 ×", "recorded remote", "fwd_bwd_per_step", 1),
    ("docs/service.md", "for 8 s", "recorded load", "seconds", 1),
    ("docs/tinker.md", "runs 16 SDK clients", "recorded load-tinker", "clients", 1),
    ("docs/service.md", "take 0.15 of the memory", "recorded multilora", "mem_ratio", 1),
    ("docs/service.md", "one slot takes 32 runs", "recorded multilora", "max_jobs", 1),
]  # fmt: skip


def bench_number_problems(words: str, fields: dict[str, str], key: str, factor: float) -> list[str]:
    """Why the first number of ``words`` does not state ``fields[key]`` × ``factor`` (empty when it does)."""
    if key not in fields:
        return [f"{words!r}: the bench printed no {key}="]
    stated_text = re.search(rf"{_NUMBER}", words)
    assert stated_text is not None, words
    stated, value = float(stated_text[0]), float(fields[key]) * factor
    if re.search(r"~|\babout\b", words):
        agrees = abs(value - stated) <= 0.25 * stated
    else:
        decimals = len(stated_text[0].partition(".")[2])
        agrees = round(value, decimals) == stated
    return [] if agrees else [f"{words!r} states {stated_text[0]}, the bench gives {key}={fields[key]} (x {factor:g})"]


def recorded(name: str) -> dict[str, str]:
    """The fields of ``bench/results/<name>.txt``'s summary line (its last line)."""
    path = RESULTS / f"{name}.txt"
    command = f"python -m bench {name.replace('-', ' --api ')} --record"  # load-tinker: load --api tinker
    assert path.is_file(), f"no {path.relative_to(ROOT)}: run `{command}` and commit it"
    return summary_fields(path.read_text(encoding="utf-8").strip().splitlines()[-1])


_SMOKE_OUTPUTS: dict[str, dict[str, str]] = {}


def smoke(name: str) -> dict[str, str]:
    """The fields of ``python -m bench <name> --smoke``'s summary line (run once per test process)."""
    if name not in _SMOKE_OUTPUTS:
        command = [sys.executable, "-m", "bench", name, "--smoke"]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-4000:]
        _SMOKE_OUTPUTS[name] = summary_fields(result.stdout.strip().splitlines()[-1])
    return _SMOKE_OUTPUTS[name]


@pytest.mark.parametrize(("doc", "words", "source", "key", "factor"), BENCH_NUMBERS)
def test_each_bench_number_a_doc_states_is_what_the_bench_prints(doc, words, source, key, factor):
    flat = " ".join(re.sub(r"`[^`]*`", "", (ROOT / doc).read_text(encoding="utf-8")).split())
    assert words in flat, f"{doc} no longer says {words!r}"
    how, name = source.split()
    fields = smoke(name.split("-")[0]) if how == "smoke" else recorded(name)
    assert bench_number_problems(words, fields, key, factor) == []


def test_bench_number_check_catches_a_wrong_number():
    fields = {"ratio": "0.0512", "throughput_ratio": "1.2", "seconds": "8"}  # "about": within a quarter
    assert bench_number_problems("moves 3.4% of the weights", fields, "ratio", 100) == [
        "'moves 3.4% of the weights' states 3.4, the bench gives ratio=0.0512 (x 100)"
    ]
    assert bench_number_problems("about 2× one run's", fields, "throughput_ratio", 1) != []
    assert bench_number_problems("about 1.5× one run's", fields, "throughput_ratio", 1) == []
    assert bench_number_problems("for 8 s", fields, "seconds", 1) == []
    assert bench_number_problems("for 8 s", fields, "clients", 1) == ["'for 8 s': the bench printed no clients="]


def test_readme_lists_every_bench():
    """``make bench`` runs every ``bench_*.py``; the README's row for it names each one."""
    from bench.__main__ import available

    row = next(line for line in (ROOT / "README.md").read_text(encoding="utf-8").splitlines() if "`make bench`" in line)
    listed = set(re.search(r"\(([^)]*)\)", row)[1].replace(";", ",").replace("then", "").replace("`", "").split(", "))
    assert set(available()) <= {name.strip() for name in listed}, row


def test_number_check_catches_an_untied_number_and_a_stale_claim():
    text = "The demo ends at 0.93 after 200 steps.\n\nIt runs `icefloe demo --seed 3` in ~70 s here."
    claims = [("x.md", "ends at 0.93", "tests/recipes/test_grpo.py::x"), ("x.md", "ends at 0.99", "bench/y.py")]
    assert uncovered("x.md", text, claims) == [
        "x.md: no reproducer for: It runs in ~70 s here.",
        "x.md: the claim 'ends at 0.99' is gone from the doc",
    ]


_FILE_NAMED = re.compile(r"`([A-Za-z0-9_./]+\.py)`")
# Where a short name in the architecture and service pages is read from: a name is found in one of these.
_NAMED_FROM = (
    "", "icefloe", "icefloe/service", "icefloe/service/hosts", "icefloe/client", "icefloe/client/remote",
    "icefloe/engines", "tests/faults",
)  # fmt: skip


@pytest.mark.parametrize("page", ["docs/architecture.md", "docs/service.md"])
def test_every_file_the_layer_pages_name_exists(page):
    """A page that names a file the code no longer has (a module renamed or merged) is out of date."""
    root = Path(__file__).resolve().parents[1]
    named = set(_FILE_NAMED.findall((root / page).read_text()))
    missing = sorted(name for name in named if not any((root / base / name).is_file() for base in _NAMED_FROM))
    assert missing == [], f"{page} names files that do not exist: {missing}"

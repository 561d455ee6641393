"""The README and the documents it links stay true to the checkout.

* The README's two commands (the main job, the tests) are there, and CI (``.ci/run``) runs the
  README's test command.
* Every relative link of the README, docs/ and experiments/*.md points at a file that exists.
* Every experiment script is in the index (experiments/README.md).
* Records are named by date and commit: no "session N" wording in these documents (paths of the
  notes files are names, not wording).
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "gpu_usage.md", ROOT / "experiments" / "README.md",
        ROOT / "experiments" / "RESULTS.md"]

MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e "
            "'.[cuda13,experiments,real]' && python experiments/real_model.py")
TESTS = ("python3 -m venv .venv && . .venv/bin/activate && python -m pip install -e '.[test]' "
         "&& python -m pytest -q")


def _bash_blocks(text: str) -> list:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S)]


def test_readme_keeps_the_two_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    assert MAIN_JOB in blocks and TESTS in blocks, blocks
    assert (ROOT / "experiments" / "real_model.py").is_file()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    test_command = TESTS.rsplit("&& ", 1)[1]
    assert ci[-1] == test_command, ci[-1]  # CI ends with the README's test command
    assert any("pip install -e '.[test" in line for line in ci), ci


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 220


def test_relative_links_exist():
    missing = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (doc.parent / target.split("#")[0]).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not missing, missing


def test_every_experiment_script_is_indexed():
    index = (ROOT / "experiments" / "README.md").read_text()
    scripts = sorted(p.name for p in (ROOT / "experiments").glob("*.py")) + \
        ["run_gpu_experiments.sh"]
    assert not [s for s in scripts if f"`{s}`" not in index]


def test_records_are_named_by_date_and_commit():
    found = [f"{d.relative_to(ROOT)}: {m}" for d in DOCS
             for m in re.findall(r"(?i)\bsessions? \d+", d.read_text())]
    assert not found, found

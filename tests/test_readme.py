"""The README's first two commands are the ones CI runs."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_exactly_two_commands():
    lines = (REPO / "README.md").read_text().splitlines()
    assert lines[2] == "```sh" and lines[5] == "```"
    assert len(readme_commands()) == 2


def test_ci_installs_and_tests_as_the_readme_says():
    install, test = readme_commands()
    ci = (REPO / ".ci" / "run").read_text()
    assert install.removesuffix(" && .venv/bin/pantheon serve") in ci
    assert test in ci.splitlines()

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


def test_readme_device_memory_figures_match_the_default_model(smollm2_path):
    """The KV figures in "Numerics and device memory" are the allocation's, not guesses."""
    from pantheon.config import ModelConfig
    from pantheon.engine.pool import estimate_device_bytes

    text = (REPO / "README.md").read_text()
    mib = 1 << 20
    per_slot = (estimate_device_bytes(str(smollm2_path), 4096, 1) - estimate_device_bytes(str(smollm2_path), 4096, 0))
    assert f"**{per_slot // mib} MiB** of KV cache per 4096-token slot" in text
    default = ModelConfig(path="", name="")
    slots = max(default.max_sessions, default.max_concurrent_configured) + 1  # + the scratch slot
    assert default.ctx_cap == 4096 and f"{slots} x {per_slot // mib} = **{slots * per_slot // mib} MiB**" in text


def test_readme_examples_are_what_a_shell_runs():
    text = (REPO / "README.md").read_text()
    assert "--raw $'<|im_start|>user\\nHi" in text  # "\n" inside double quotes stays two characters
    assert "the default of `pantheon generate`" not in text  # exact is every command's default

"""config.py is the one module that reads the environment: names, defaults and parsing in one place
(PANTHEON_TOOL_GRAMMAR was once parsed in two modules by different rules)."""

from __future__ import annotations

import re
from pathlib import Path

from pantheon import config
from pantheon.text.tools.grammar import tool_grammar_policy

ROOT = Path(__file__).resolve().parents[1] / "pantheon"
READS = re.compile(r"\bos\.(environ|getenv|putenv|unsetenv)\b|\bgetenv\(")


def test_only_config_reads_the_environment():
    found = [f"{p.relative_to(ROOT.parent)}:{i}: {line.strip()}"
             for p in sorted(ROOT.rglob("*.py")) if p.name != "config.py" or p.parent != ROOT
             for i, line in enumerate(p.read_text().splitlines(), 1) if READS.search(line)]
    assert not found, "\n".join(found)


def test_tool_grammar_is_parsed_once(monkeypatch):
    cases = {None: "required", "": "required", "0": "off", " 0 ": "off", "1": "all", "yes": "required"}
    for value, mode in cases.items():
        if value is None:
            monkeypatch.delenv(config.ENV_TOOL_GRAMMAR, raising=False)
        else:
            monkeypatch.setenv(config.ENV_TOOL_GRAMMAR, value)
        assert config.tool_grammar() == mode, value
        # the grammar policy (text/) and the thinking rule (engine/chat.py) read this one answer
        assert (tool_grammar_policy("auto", True) == ("auto", None)) == (mode == "all"), value
        assert (tool_grammar_policy("required", True) is None) == (mode == "off"), value

"""README is the entrance: its set-up commands stay as CI and the tests know them, and its
links lead somewhere. (Its Python example moved to docs/how-to/python.md, which
tests/test_docs.py runs.)"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
            "reservoir model tiny models/tiny && "
            "reservoir run examples/reverse_grpo/config.yaml && "
            "reservoir sql \"SELECT step, round(reward_mean::numeric, 3) AS reward_mean, "
            "response_len_mean FROM analytics.run_steps WHERE run = 'reverse-grpo' ORDER BY step "
            "DESC LIMIT 5\"")
TESTS = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[dev]' && "
         "python -m pytest")


def test_the_set_up_commands_stay_as_they_are():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL).group(1)
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert commands == [MAIN_JOB, TESTS]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q -e '.[dev]'" in ci
    assert "reservoir run examples/reverse_grpo/config.yaml" in ci


def test_every_link_in_the_readme_leads_to_a_file():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert local, "README links into the docs"
    assert [t for t in local if not (ROOT / t).exists()] == []

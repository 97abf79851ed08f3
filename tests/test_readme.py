"""README's Python example runs as written, against a fresh database."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_python_example_runs(db_url, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its Python example"
    monkeypatch.setenv("RESERVOIR_DB_URL", db_url)
    code = blocks[0].replace("    ...", "    assert len(lease.rows) == 4")
    exec(compile(code, str(README), "exec"), {})

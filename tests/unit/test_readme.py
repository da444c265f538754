"""The README's example is executed, so it stays true as the API grows."""

import re
from pathlib import Path


def test_readme_example_runs(capsys):
    text = (Path(__file__).parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has a python example"
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {})
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[101]"
    assert "room=102" in out[1]
    assert out[2] == "1"

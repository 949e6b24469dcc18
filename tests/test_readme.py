"""The README's library example runs as printed: the fenced ```python block after the line
`<!-- library example: run by tests/test_readme.py -->` is executed verbatim, from a folder
outside the repository (it names bundled models, which work from anywhere)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "<!-- library example: run by tests/test_readme.py -->"


def library_example():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as handle:
        text = handle.read()
    assert text.count(MARKER) == 1, "the README marks exactly one library example"
    found = re.match(r"\s*```python\n(.*?)\n```", text.split(MARKER, 1)[1], re.S)
    assert found, "the marker is followed by a ```python block"
    return found.group(1)


def test_the_readme_library_example_runs_verbatim(monkeypatch, capsys, tmp_path):
    code = library_example()
    assert 5 <= len(code.splitlines()) <= 20
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md (library example)", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out
    assert re.search(r"footprint [\d,]+ bytes", printed), printed

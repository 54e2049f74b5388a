"""The documentation: the site builds with `mkdocs build --strict`, and its examples run.

Every ```python block of a page is executed, in order, as one script per page in a fresh
interpreter (the pages set up their own CPU devices, as a reader would). Blocks that cannot
run here (Flax, Equinox, Orbax, several processes) are fenced as ```py instead: highlighted
the same, never executed.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
# A fenced block, possibly indented (inside a list item): group 1 is the indentation.
_BLOCK = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^\1```[ \t]*$", re.MULTILINE | re.DOTALL)


def _code(page):
  """The ```python blocks of a page, dedented, in order."""
  return [textwrap.dedent(code) for _, code in _BLOCK.findall((DOCS / page).read_text())]


def _shown_outputs(page):
  """{index of a ```python block: the ```text block right after it} (its printed output)."""
  text = (DOCS / page).read_text()
  shown = {}
  for i, match in enumerate(_BLOCK.finditer(text)):
    after = re.match(r"\s*\n([ \t]*)```text[ \t]*\n(.*?)^\1```", text[match.end():],
                     re.MULTILINE | re.DOTALL)
    if after:
      shown[i] = textwrap.dedent(after.group(2))
  return shown


_SEPARATOR = "----- end of block -----"


def _env():
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"     # the examples simulate devices on the CPU
  env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's end-of-life banner
  return env


def test_site_builds_strict(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
      cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-5000:]}"
  assert (tmp_path / "index.html").exists()
  assert (tmp_path / "api" / "optax" / "index.html").exists()


def test_readme_example_runs(tmp_path):
  blocks = [textwrap.dedent(code) for _, code in _BLOCK.findall((ROOT / "README.md").read_text())]
  assert blocks, "README.md has no ```python example"
  script = tmp_path / "readme.py"
  script.write_text("\n".join(blocks))
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"README.md's example failed:\n{result.stderr[-5000:]}"


def test_every_page_is_in_the_nav():
  nav = (ROOT / "mkdocs.yml").read_text()
  missing = [p for p in PAGES if p not in nav]
  assert not missing, f"pages missing from mkdocs.yml nav: {missing}"


@pytest.mark.parametrize("page", [p for p in PAGES if _code(p)])
def test_page_examples_run(page, tmp_path):
  blocks = _code(page)
  script = tmp_path / "page.py"
  script.write_text(f"\nprint({_SEPARATOR!r})\n".join(blocks))
  result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, (
      f"the ```python blocks of docs/{page} failed:\n{result.stderr[-5000:]}")
  # Output shown in the page (a ```text block right after the code) is what it prints.
  printed = result.stdout.split(_SEPARATOR + "\n")
  for i, shown in _shown_outputs(page).items():
    assert printed[i].rstrip() == shown.rstrip(), (
        f"docs/{page}: block {i} prints\n{printed[i]}\nbut the page shows\n{shown}")


def test_ci_runs_the_readme_test_command_verbatim():
  """README's two set-up commands: the test one is exactly what .ci/run executes."""
  readme = (ROOT / "README.md").read_text()
  commands = [line.strip() for line in readme.splitlines()
              if line.startswith("    pip install -e ")]
  assert len(commands) == 2, commands  # one for the demo, one for the tests
  demo, tests = sorted(commands, key=lambda c: "pytest" in c)
  assert demo.endswith("python -m jpack demo") and tests.endswith("python -m pytest")
  ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
  assert tests in ci

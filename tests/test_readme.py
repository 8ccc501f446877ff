"""The README as a user reads it: short, its figures equal the result pages' JSON, and the
output it shows is what the command prints on this checkout."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("results_generate",
                                                  ROOT / "docs" / "results" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_short_guide() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    # development history: session ordinals, issue numbers, "was X before"
    words = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"
                       r"|eleventh|twelfth|thirteenth|fourteenth) session\b|\bissue \d+"
                       r"|\bwas \S+ before\b", re.I)
    assert not words.findall(text)


def test_the_results_summary_is_rendered_from_the_result_pages_json() -> None:
    """`python docs/results/generate.py` leaves the README as it is: its figures are the
    JSON's (a drifted README or a newer run not rendered fails here)."""
    text = README.read_text()
    assert "<!-- results:readme -->" in text
    assert _generator().fill(text) == text


def test_the_sim_output_shown_is_what_the_command_prints() -> None:
    block = re.search(r"```console\n\$ (kvprefetch [^\n]+)\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    command, shown = block.group(1).split(), block.group(2).splitlines()
    out = subprocess.run([sys.executable, "-m", "kvprefetch", *command[1:], "--no-progress"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    printed = {" ".join(line.split()) for line in out.stdout.splitlines()}
    for line in shown:
        assert " ".join(line.split()) in printed, line


def test_the_install_section_says_how_to_install_without_a_package_index() -> None:
    """No release is on a package index: the README installs from a clone or from the wheel
    ``make wheel`` builds, and the Makefile has that target."""
    text = README.read_text()
    install = text[text.index("## Install"):text.index("\n## ", text.index("## Install") + 1)]
    assert not re.search(r"pip install '?kvprefetch\b", install)
    assert "pip install -e '.[serve,stores]'" in install and "make wheel" in install
    assert re.search(r"^wheel:\n\t\$\(PYTHON\) -m pip wheel .* -w dist \.$",
                     (ROOT / "Makefile").read_text(), re.M)


def _site_url() -> str:
    import yaml

    url = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"]
    assert isinstance(url, str) and url.startswith("https://") and url.endswith("/")
    return url


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs gives the page's headings (its toc extension's default slugs)."""
    heads = re.findall(r"^#{1,6} +(.+?) *$", page.read_text(), re.M)
    return {re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in heads}


def test_the_readmes_links_are_absolute_into_the_documentation_site() -> None:
    """On a package index page a relative link is dead: every link of the README outside
    the generated results table is absolute, into the site (``site_url``, the package's
    Documentation URL), and lands on a page of docs/ and a heading of it."""
    import tomllib

    text = README.read_text()
    table = text[text.index("<!-- results:readme -->"):text.index("<!-- /results:readme -->")]
    links = re.findall(r"\]\(([^)\s]+)\)", text.replace(table, ""))
    assert links
    url = _site_url()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["urls"]["Documentation"] == url
    for link in links:
        assert link.startswith(url), link
        path, _, anchor = link.removeprefix(url).partition("#")
        page = ROOT / "docs" / (path.rstrip("/") + ".md" if path else "index.md")
        if not page.exists():
            page = ROOT / "docs" / path / "index.md"
        assert page.exists(), link
        assert not anchor or anchor in _anchors(page), link


def test_every_bucket_the_readme_and_docs_name_is_a_valid_s3_bucket_name() -> None:
    """A user pastes these: 3 to 63 lowercase letters, digits, dots and hyphens, starting
    and ending with a letter or digit (S3's rules); the deploy placeholder counts once
    filled in."""
    pages = [README, *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").rglob("*.y*ml"))]
    named = re.compile(r'"bucket": ?"([^"]*)"|\bbucket: ([^\s,#}]+)')
    names = [name for page in pages for name in named.findall(page.read_text())]
    buckets = {(a or b).replace("REPLACE_ME", "acme") for a, b in names}
    assert buckets
    valid = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
    assert {b for b in buckets if not valid.match(b)} == set()

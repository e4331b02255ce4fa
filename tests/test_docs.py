"""README.md and the docs/ pages hold together: every relative link points at a file that exists (and, where it
names an anchor in a markdown file, at a heading of that file), every docs page is linked from README's
"Reference" list and links back to README, and every repository file the pages cite exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: ``[text](target)``; the target up to the first space or closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: A file of the repository a page names in its text (``tests/test_hf.py``, ``examples/nemo_rl/….yaml``).
CITED = re.compile(r"\b(?:bench|scripts|examples|tests)/[A-Za-z0-9_./-]+\.(?:py|yaml)\b")


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _outside_code(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, every character but letters, digits, ``_``, ``-`` and spaces
    dropped, spaces turned into ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated heading gets ``-1``, ``-2``, … as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in _outside_code(page.read_text()):
        m = re.match(r"#{1,6} +(.*?)#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """The link targets of a markdown file, outside code blocks and code spans."""
    text = "\n".join(_outside_code(page.read_text()))
    return LINK.findall(re.sub(r"`[^`\n]*`", "``", text))


def broken_links(pages: list[Path]) -> list[tuple[str, str]]:
    """(page, target) for every relative link of the pages whose file does not exist, or whose anchor is no heading
    of the markdown file it points at. Links with a scheme (``https:``, ``mailto:``) are not followed."""
    broken = []
    for page in pages:
        for target in links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append((page.name, target))
    return broken


def test_every_relative_link_resolves():
    pages = doc_pages()
    assert len(pages) > 1 and sum(len(links(p)) for p in pages) > 20
    assert broken_links(pages) == []


def test_a_missing_link_is_detected(tmp_path):
    """The control: the same function finds a link to a file that does not exist and an anchor no heading has."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Title\n\n## Reference (`--flag`)\n\n[ok](docs/a.md) [ok](docs/a.md#a-section) [ok](#reference---flag)\n"
        "[gone](docs/missing.md) [web](https://example.com/x.md)\n```\n[in code](docs/nowhere.md)\n```\n")
    (tmp_path / "docs/a.md").write_text("# A\n\n## A section\n\n[back](../README.md) [bad anchor](a.md#no-such)\n"
                                        "`[in a code span](nowhere.md)`\n")
    assert broken_links(doc_pages(tmp_path)) == [("README.md", "docs/missing.md"), ("a.md", "a.md#no-such")]


def test_slug_is_githubs():
    assert slug("Hugging Face / TRL") == "hugging-face--trl"
    assert slug("Megatron-Bridge's Nemotron Omni path (`--preset megatron-bridge-nemotron-omni`)") == \
        "megatron-bridges-nemotron-omni-path---preset-megatron-bridge-nemotron-omni"


def test_every_docs_page_is_linked_from_the_readme_and_back():
    readme = ROOT / "README.md"
    reference = readme.read_text().split("\n## Reference\n", 1)[1]
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs
    for page in docs:
        assert f"(docs/{page.name})" in reference, page.name
        title, _, back = page.read_text().split("\n", 3)[:3]
        assert title.startswith("# ") and "](../README.md)" in back, page.name


def test_the_files_the_pages_cite_exist(tmp_path):
    cited = {(p.name, c) for p in doc_pages() for c in CITED.findall(p.read_text())}
    assert len(cited) > 10
    assert sorted(c for c in cited if not (ROOT / c[1]).exists()) == []
    page = tmp_path / "README.md"  # the control
    page.write_text("run `bench/bench_read.py`, then `scripts/no_such_script.py`")
    assert [c for c in CITED.findall(page.read_text()) if not (ROOT / c).exists()] == ["scripts/no_such_script.py"]

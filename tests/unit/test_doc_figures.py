"""Every percentage and ratio the docs quote is in the committed results file they name.

The project's rule: a figure in docs/ or a README is quoted from a results file under
benchmarks/results/ (written by its benchmark script alone). This test extracts every
percentage (`46.2 %`, `46%`, ranges `24-90 %`, `+0.05-0.20 %`) and every ratio (`3.7x`,
`0.11-0.27x`, `x1.54`) and looks for each number, as written, in the results files:

- docs/benchmarks.md and docs/control_plane.md, section by section: a figure must appear in
  a results file the section names (in its heading or text), or, where the section names
  none, in one the page names. Every results file a page names must exist.
- every other page (README.md, docs/*.md, benchmarks/README.md), block by block (a
  paragraph, a list item, a table row): a figure in a block that names a results file must
  appear in one it names. benchmarks/README.md may quote no figure outside such a block.

A number appears when the results file holds it as a whole number token: `3.7` does not
match `13.7` or `3.71` (quote the file's digits, do not round). A range passes when both
ends appear.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SECTIONED = ("docs/benchmarks.md", "docs/control_plane.md")
STRICT = ("benchmarks/README.md",)

_NUM = r"\d+(?:\.\d+)?"
_START = r"(?<![\w.,])"  # not inside a word, a decimal or a thousands group
_END = r"(?![\w]|\.\d)"
PERCENT = re.compile(rf"{_START}(?P<a>{_NUM})(?:\s?-\s?(?P<b>{_NUM}))?\s?%")
RATIO = re.compile(rf"{_START}(?P<a>{_NUM})(?:-(?P<b>{_NUM}))?x{_END}")
RATIO_PREFIX = re.compile(rf"(?<![\w.])x(?P<a>{_NUM}){_END}")
FILE = re.compile(r"(?P<dir>(?:benchmarks/)?results/)?(?<![\w.-])(?P<name>[A-Za-z0-9_]+\.txt)\b")


def figures(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(figure as written, its numbers) for every percentage and ratio in `text`."""
    found = []
    for pattern in (PERCENT, RATIO, RATIO_PREFIX):
        for m in pattern.finditer(text):
            numbers = tuple(n for n in m.groupdict().values() if n is not None)
            found.append((m.group(0), numbers))
    return found


def named_results(text: str, must_exist: bool = False) -> set[str]:
    """The committed results files `text` names (`benchmarks/results/x.txt`, `results/x.txt`,
    `x.txt`); with `must_exist`, a `results/` path that is not committed is an error."""
    names = set()
    for m in FILE.finditer(text):
        path = RESULTS / m.group("name")
        if must_exist and m.group("dir") and not path.is_file():
            raise AssertionError(f"names {m.group(0)}, which is not a committed results file")
        if path.is_file():
            names.add(m.group("name"))
    return names


def appears(number: str, text: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d|\.\d)", text) is not None


def _missing(figs, files: set[str]) -> list[str]:
    texts = {name: (RESULTS / name).read_text() for name in files}
    bad = []
    for written, numbers in figs:
        if not any(all(appears(n, t) for n in numbers) for t in texts.values()):
            bad.append(f"{written!r} (not in {', '.join(sorted(files)) or 'any named file'})")
    return bad


def _unfenced(text: str) -> list[tuple[bool, str]]:
    """(inside a code fence, line) for every line."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append((True, line))
        else:
            out.append((fenced, line))
    return out


def sections(text: str) -> list[str]:
    """The page cut at its headings (lines opening with # outside code fences)."""
    parts: list[list[str]] = [[]]
    for fenced, line in _unfenced(text):
        if not fenced and line.startswith("#"):
            parts.append([])
        parts[-1].append(line)
    return ["\n".join(p) for p in parts if p]


def blocks(text: str) -> list[str]:
    """Headings, paragraphs, list items and table rows (a code fence is one block)."""
    out: list[list[str]] = [[]]
    was_fenced = False
    for fenced, line in _unfenced(text):
        if fenced and not was_fenced:
            out.append([])  # a fence opens
        elif not fenced and line.startswith("#"):
            out += [[line], []]  # a heading is a block of its own
            continue
        elif not fenced and (was_fenced or not line.strip()
                             or re.match(r"\s*(?:[-*] |\d+\. |\|)", line)):
            out.append([])  # a fence closed, a blank line, a list item or a table row
        if line.strip():
            out[-1].append(line)
        was_fenced = fenced
    return ["\n".join(b) for b in out if b]


def _read(rel: str) -> str:
    return (ROOT / rel).read_text()


# -- the extraction itself ------------------------------------------------------------

def test_extraction_finds_percentages_and_ratios():
    text = ("gaps 46.2-69.7 % of (b)'s, 46% once, +24-90 % and +0.05-0.20 % of a core; "
            "by 3.7-9.1x (0.11-0.27x), 2.15x the goal, 1.29x, p50 x1.54 (p99 x0.75).")
    assert [f[1] for f in figures(text)] == [
        ("46.2", "69.7"), ("46",), ("24", "90"), ("0.05", "0.20"),
        ("3.7", "9.1"), ("0.11", "0.27"), ("2.15",), ("1.29",), ("1.54",), ("0.75",)]


def test_extraction_ignores_dates_hashes_ports_and_section_numbers():
    text = ("2026-12-01, commit a8ffad9 and 0x1f2e, 127.0.0.1:8000, section 4.2, issue 26, "
            "x86_64, Linux-6.18.44-fc-v669, 16 x 3 heads, 1k-8k tokens, (b)/(a) 1.64, "
            "load 1.8 -> 6.2, `--mix 128:0.5`, v1.2x3")
    assert figures(text) == []


def test_a_number_must_appear_whole():
    assert appears("3.7", "at 3.7 ms") and appears("46.2", "0.6/s: 46.2% of 2518")
    assert not appears("3.7", "13.7 ms") and not appears("3.7", "3.71") and not appears("13.5", "13.51")
    assert not appears("5", "2.5 ms") and appears("0.2", "goal <= +0.2)")


def test_blocks_and_sections_split_where_markdown_does():
    text = "# A\npara one\nstill one\n\n- item `results/x.txt`\n- item two\n| a | b |\n## B\ntext"
    assert blocks(text) == ["# A", "para one\nstill one", "- item `results/x.txt`", "- item two",
                            "| a | b |", "## B", "text"]
    assert [s.splitlines()[0] for s in sections(text)] == ["# A", "## B"]


# -- the pages ------------------------------------------------------------------------

@pytest.mark.parametrize("page", SECTIONED)
def test_sectioned_page_figures_are_in_its_results_files(page):
    text = _read(page)
    page_files = named_results(text, must_exist=True)
    assert page_files, f"{page} names no results file"
    bad = []
    for section in sections(text):
        files = named_results(section, must_exist=True) or page_files
        bad += [f"{section.splitlines()[0][:60]!r}: {b}" for b in _missing(figures(section), files)]
    assert not bad, f"{page} quotes figures its results files do not hold:\n" + "\n".join(bad)


def _other_pages() -> list[str]:
    pages = ["README.md", "benchmarks/README.md"]
    pages += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return [p for p in pages if p not in SECTIONED]


@pytest.mark.parametrize("page", _other_pages())
def test_figures_next_to_a_results_file_are_in_it(page):
    bad = []
    for block in blocks(_read(page)):
        files = named_results(block)
        figs = figures(block)
        if files:
            bad += [f"{block[:60]!r}: {b}" for b in _missing(figs, files)]
        elif figs and page in STRICT:
            bad += [f"{block[:60]!r}: {w!r} names no results file" for w, _ in figs]
    assert not bad, f"{page} quotes figures no named results file holds:\n" + "\n".join(bad)


def _verify_cost(page: str) -> list[tuple[str, ...]]:
    # the prose that quotes it (the settings table's row, generated from the model, carries no figure)
    block = next(b for b in blocks(_read(page)) if "transfer.verify" in b and "sample" in b and not b.startswith("|"))
    return [n for _, n in figures(block)]


def test_the_verify_cost_is_quoted_alike():
    readme, configuration = _verify_cost("README.md"), _verify_cost("docs/configuration.md")
    assert readme and readme == configuration
    transfer = (RESULTS / "transfer.txt").read_text()
    assert all(appears(n, transfer) for fig in readme for n in fig)

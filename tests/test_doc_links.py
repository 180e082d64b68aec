"""Every relative link in README.md and docs/**/*.md leads somewhere: the file exists, and a
``page.md#anchor`` (or ``#anchor`` on the same page) names one of that page's headings, slugged as
GitHub does (lowercase, punctuation but '-' and '_' dropped, each space a '-', repeats numbered)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:.(?!\1))*?.?\1")
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a '# comment' in a bash block is no heading)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: Counter[str] = Counter()
    for line in prose_lines(page.read_text(encoding="utf-8")):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.extend((number, target) for target in LINK.findall(CODE_SPAN.sub("", line)))
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}:{number}: ({target})"
        if not dest.exists():
            problems.append(f"{where} no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where} no heading with that anchor in {dest.relative_to(root)}")
    return problems


def test_slugs_follow_github():
    assert slug("M = 4, 5,000 inner steps, seed 1") == "m--4-5000-inner-steps-seed-1"
    assert slug("Over seeds: `mini`, 1,000 inner steps") == "over-seeds-mini-1000-inner-steps"
    assert slug("Overlap that fits the link (`algo.auto`)") == "overlap-that-fits-the-link-algoauto"
    assert slug("In `model.init_from`") == "in-modelinit_from"


def test_a_missing_file_or_anchor_is_caught(tmp_path):
    (tmp_path / "b.md").write_text("# Title\n\n## A part\n\n## A part\n```bash\n# not a heading\n```\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-part) [ok](b.md#a-part-1) [ok](#here) `[code](nowhere.md)`\n# Here\n"
        "[gone](c.md) [bad](b.md#not-a-heading) [bad](#nowhere) [web](https://example.com/x.md)\n"
    )
    assert broken_links(page, tmp_path) == [
        "a.md:3: (c.md) no such file",
        "a.md:3: (b.md#not-a-heading) no heading with that anchor in b.md",
        "a.md:3: (#nowhere) no heading with that anchor in a.md",
    ]


def test_every_relative_link_in_the_docs_leads_somewhere():
    assert len(pages()) > 5
    problems = [problem for page in pages() for problem in broken_links(page)]
    assert not problems, "broken links:\n" + "\n".join(problems)

"""The README's table of contents (issue 25, item 9): every link in it leads to a heading,
and every ``##`` section is listed. ``python tests/test_readme_toc.py`` prints the contents
for the headings as they are now, to paste after the quick start."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
TOC_HEADING = "## Contents"


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every ``##``/``###`` heading outside fenced code blocks."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#{2,3}) (.+)", line)):
            found.append((len(match.group(1)), match.group(2).strip()))
    return found


def slug(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def anchors(text: str) -> dict[str, tuple[int, str]]:
    """Every heading's anchor; a repeated title gets -1, -2 ... as on GitHub."""
    seen: dict[str, int] = {}
    result = {}
    for level, title in headings(text):
        base = slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result[base if count == 0 else f"{base}-{count}"] = (level, title)
    return result


def toc(text: str) -> str:
    lines = []
    for anchor, (level, title) in anchors(text).items():
        if title != TOC_HEADING[3:]:
            lines.append(f"{'  ' * (level - 2)}- [{title}](#{anchor})")
    return "\n".join(lines)


def toc_links(text: str) -> list[tuple[str, str]]:
    start = text.index(f"\n{TOC_HEADING}\n")
    body = text[start + len(TOC_HEADING) + 2:text.index("\n## ", start + 1)]
    return re.findall(r"^\s*- \[([^\]]+)\]\(#([^)]+)\)$", body, re.M)


def test_the_contents_follow_the_quick_start():
    titles = [title for level, title in headings(README.read_text()) if level == 2]
    assert titles[titles.index("Quick start") + 1] == TOC_HEADING[3:]


def test_every_contents_link_leads_to_its_heading():
    text = README.read_text()
    targets = anchors(text)
    links = toc_links(text)
    assert len(links) > 20
    for title, anchor in links:
        assert anchor in targets, f"#{anchor} ({title}) is no heading of the README"
        assert targets[anchor][1] == title, f"#{anchor} is {targets[anchor][1]!r}, not {title!r}"


def test_every_section_is_in_the_contents():
    text = README.read_text()
    listed = {anchor for _, anchor in toc_links(text)}
    for anchor, (level, title) in anchors(text).items():
        if level == 2 and title != TOC_HEADING[3:]:
            assert anchor in listed, f"## {title} is missing from the README's contents"


def test_every_link_within_the_readme_leads_to_a_heading():
    text = README.read_text()
    targets = anchors(text)
    assert not [link for link in re.findall(r"\]\(#([^)]+)\)", text) if link not in targets]


def test_no_long_sentence_is_said_twice():
    """A paragraph pasted twice (the chaos soak's was) repeats its sentences."""
    prose = re.sub(r"```.*?```", "", README.read_text(), flags=re.S)
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(prose.split()))
    long = [sentence for sentence in sentences if len(sentence) > 80]
    assert not {sentence for sentence in long if long.count(sentence) > 1}


if __name__ == "__main__":
    print(toc(README.read_text()))

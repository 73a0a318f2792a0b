"""The documentation site (mkdocs.yml, docs/) and the README that leads to it (issue 42).

Every page is in the navigation and every entry of the navigation is a page; the README
stays short and its links lead to pages and headings that exist; the strict build passes,
and fails on what it must catch (a broken link or anchor, a page left out of the navigation).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import yaml

from support.docs import DOCS, README, pages, text
from support.supervision import ROOT

CONFIG = ROOT / "mkdocs.yml"


def nav_pages(entries: list[object]) -> list[str]:
    """The pages the navigation lists, in order (sections walked)."""
    found: list[str] = []
    for entry in entries:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        if isinstance(value, list):
            found += nav_pages(value)
        else:
            found.append(str(value))
    return found


def slug(title: str) -> str:
    """A heading's anchor as the site makes it (Python-Markdown's toc slugify)."""
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def anchors(page: str) -> set[str]:
    """The anchors of a page's headings (outside fenced code)."""
    found, fenced = set(), False
    for line in text(page).splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            found.add(slug(match.group(1).strip()))
    return found


def test_every_page_is_in_the_navigation_once_and_every_entry_is_a_page():
    listed = nav_pages(yaml.safe_load(CONFIG.read_text())["nav"])
    assert sorted(listed) == pages()
    assert len(set(listed)) == len(listed)


def test_the_readme_is_short_and_leads_to_the_pages():
    readme = text(README)
    assert len(readme.splitlines()) <= 200
    linked = set(re.findall(r"\]\(docs/([\w./-]+\.md)", readme))
    assert len(linked) >= 10


def test_every_link_of_the_readme_into_the_docs_leads_to_a_heading():
    for page, anchor in re.findall(r"\]\(docs/([\w./-]+\.md)(?:#([\w-]+))?\)", text(README)):
        assert (DOCS / page).is_file(), page
        assert not anchor or anchor in anchors(page), f"docs/{page}#{anchor}"


@pytest.mark.parametrize("name", [README, *pages()])
def test_no_long_sentence_is_said_twice(name):
    """A paragraph pasted twice (the chaos soak's once was) repeats its sentences."""
    prose = re.sub(r"```.*?```", "", text(name), flags=re.S)
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(prose.split()))
    long = [sentence for sentence in sentences if len(sentence) > 80]
    assert not {sentence for sentence in long if long.count(sentence) > 1}


# --- the strict build -----------------------------------------------------------------------

def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="the extra 'docs' is not installed")
    pytest.importorskip("material", reason="the extra 'docs' is not installed")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           str(config), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    done = build(CONFIG, tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


#: The faults the strict build must catch, made in a copy of the sources, and the warning
#: that names each.
FAULTS = {
    "a missing anchor": "does not contain an anchor '#no-such-heading'",
    "a missing page": "'configurations.md#retries-and-backoff'",
    "a page left out of the navigation": 'not included in the "nav" configuration:\n  - extra.md\n',
}


def broken_copy(tmp_path: Path) -> Path:
    """The site's sources laid out as in the checkout, with every one of FAULTS made."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(CONFIG, tmp_path / "mkdocs.yml")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "docs_hooks.py", tmp_path / "scripts")
    (tmp_path / "bench").symlink_to(ROOT / "bench")  # the benchmark results pages link
    page = tmp_path / "docs" / "handlers.md"
    link = "](configuration.md#retries-and-backoff)"
    assert page.read_text().count(link) == 1
    broken = " ([a](configurations.md#retries-and-backoff), [b](configuration.md#no-such-heading))"
    page.write_text(page.read_text().replace(link, link + broken))
    (tmp_path / "docs" / "extra.md").write_text("# Extra\n")
    return tmp_path / "mkdocs.yml"


@pytest.mark.slow
def test_the_strict_build_fails_on_a_broken_link_or_anchor_or_a_page_not_in_the_nav(tmp_path):
    done = build(broken_copy(tmp_path), tmp_path / "site")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "in strict mode" in output, output
    assert output.count("WARNING") == len(FAULTS), output  # these, nothing else
    for fault, warning in FAULTS.items():
        assert warning in output, fault

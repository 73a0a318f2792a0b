"""MkDocs hook: the pages' links to files of the repository outside ``docs/``.

A page links benchmark results as ``../bench/results/<run>/README.md``, which works where
the repository is browsed (GitHub, an editor) but names no page of the site. Such a link,
when its target exists, becomes a link into the repository at ``repo_url`` when the site
has one, and otherwise its text with the path beside it. A target that does not exist is
left alone, so the build's own link check reports it (strict: a failure).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

LINK = re.compile(r"(?<!!)\[([^\]\n]*)\]\((\.\./[^)\s#]+)\)")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs = Path(os.path.abspath(config["docs_dir"]))
    repository = docs.parent
    here = Path(page.file.abs_src_path).parent

    def outside(match: re.Match[str]) -> str:
        text, target = match.groups()
        path = Path(os.path.normpath(here / target))  # symbolic links kept as they are
        if path.is_relative_to(docs) or not path.exists():
            return match.group(0)
        shown = path.parent if path.name == "README.md" else path
        where = shown.relative_to(repository).as_posix() + ("/" if shown.is_dir() else "")
        if config.get("repo_url"):
            base = config["repo_url"].rstrip("/")
            return f"[{text}]({base}/tree/HEAD/{path.relative_to(repository).as_posix()})"
        if where.rstrip("/").endswith(text.strip("`").rstrip("/")):
            return f"`{where}`"
        return f"{text} (`{where}`)"

    return LINK.sub(outside, markdown)

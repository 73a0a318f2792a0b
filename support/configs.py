"""Job files written for a test and loaded (or refused) as the supervisor would load them."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from supervisor.config import Config, ConfigError, load

MINIMAL = """
[job]
queue = "stats-usage"
handler = "examples.noop:handle"
"""


def write(tmp_path: Path, text: str, name: str = "job.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load_text(tmp_path: Path, text: str, **kwargs) -> Config:
    kwargs.setdefault("environ", {})
    return load(write(tmp_path, text), **kwargs)


def error_of(tmp_path: Path, text: str, **kwargs) -> str:
    with pytest.raises(ConfigError) as caught:
        load_text(tmp_path, text, **kwargs)
    message = str(caught.value)
    assert message.startswith(str(tmp_path / "job.toml") + ": ")
    assert "\n" not in message
    return message


def with_job(extra: str, section: str = "job") -> str:
    """MINIMAL plus ``extra`` lines in ``section``."""
    if section == "job":
        return MINIMAL + textwrap.dedent(extra)
    return MINIMAL + f"[{section}]\n" + textwrap.dedent(extra)

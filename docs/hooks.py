"""MkDocs hook: fills the configuration page's `<!-- config-reference -->` with the reference
generated from the config schema and config.yaml (cluster_serving.config.reference)."""

from __future__ import annotations

from typing import Any

from cluster_serving.config.reference import config_reference

MARK = "<!-- config-reference -->"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return markdown.replace(MARK, config_reference()) if MARK in markdown else markdown

"""The configuration reference (docs/configuration.md): every key of the schema, with the values
it accepts (from the schema's types and bounds), its default and its description (both from
config.yaml, the comment lines above the key). Generated, so it cannot drift from either."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from cluster_serving.config.schema import DEFAULT_CONFIG_PATH, ServingConfig

KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[a-z_][a-z0-9_]*):")


def config_reference() -> str:
    """A markdown table: key, accepted values, default, description."""
    defaults = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text())
    comments = key_comments(DEFAULT_CONFIG_PATH.read_text())
    rows = ["| key | accepts | default | description |", "|---|---|---|---|"]
    for key, field in schema_keys(ServingConfig):
        if key not in comments:
            raise ValueError(f"{DEFAULT_CONFIG_PATH.name}: {key} has no comment to describe it")
        rows.append(f"| `{key}` | {accepts(field)} | {_default(defaults, key)} | {_cell(comments[key])} |")
    return "\n".join(rows) + "\n"


def schema_keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) for every leaf of the config: sections are walked, not listed."""
    for name, field in model.model_fields.items():
        section = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
        if section is not None:
            yield from schema_keys(section, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", field


def key_comments(text: str) -> dict[str, str]:
    """dotted key -> the comment lines right above it; a key right below a described sibling
    (no blank line between) shares its description."""
    comments: dict[str, str] = {}
    path: list[tuple[int, str]] = []
    pending: list[str] = []
    previous = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if not match:
            pending, previous = [], ""
            continue
        depth = len(match["indent"])
        path = [(indent, key) for indent, key in path if indent < depth] + [(depth, match["key"])]
        dotted = ".".join(key for _, key in path)
        if pending:
            comments[dotted] = " ".join(pending)
        elif previous and previous.rsplit(".", 1)[0] == dotted.rsplit(".", 1)[0] and previous in comments:
            comments[dotted] = comments[previous]
        pending, previous = [], dotted
    return comments


def accepts(field: FieldInfo) -> str:
    """The values a field takes, as a person reads them."""
    annotation = field.annotation
    if get_origin(annotation) is Literal:
        return " \\| ".join(f"`{choice}`" for choice in get_args(annotation))
    kind = _kind(annotation)
    bounds = [f"≥ {item.ge}" for item in field.metadata if isinstance(item, Ge)]
    bounds += [f"≤ {item.le}" for item in field.metadata if isinstance(item, Le)]
    return kind + (f" ({', '.join(bounds)})" if bounds else "")


def _kind(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, type(int | None)):
        return " or ".join(_kind(arg) for arg in args if arg is not type(None))
    if origin is tuple:
        return f"list of {_kind(args[0])}"
    if origin is dict:
        return "mapping"
    if origin is not None and hasattr(annotation, "__metadata__"):
        return _kind(args[0])
    names = {int: "integer", float: "number", str: "text", bool: "true/false"}
    if annotation in names:
        return names[annotation]
    return {"Path": "path", "PosixPath": "path"}.get(getattr(annotation, "__name__", ""), getattr(annotation, "__name__", str(annotation)))


def _default(defaults: dict[str, Any], key: str) -> str:
    value: Any = defaults
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return f"`{yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")

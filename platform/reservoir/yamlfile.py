"""YAML files people write (configs, pipelines): safe loading that refuses a key given twice
(PyYAML would silently keep the last), and the line of every key for error messages."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from reservoir.errors import ConfigError


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys in a mapping."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key (a list as a key): PyYAML's own error follows
            break
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (lines {first} and "
                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def read_yaml(path: Path | str, what: str) -> tuple[Any, dict[tuple, int]]:
    """(the document, line of every key path); ConfigError naming the file for any problem."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the {what} file: {exc}") from None
    if "\x00" in text:
        raise ConfigError(f"{path}: the {what} file holds a NUL character")
    try:
        document = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}: {exc.problem or exc.context}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    return document, key_lines(node)


def key_lines(node) -> dict[tuple, int]:
    """Line number (1-based) of every key and list item in a composed YAML document."""
    lines: dict[tuple, int] = {}

    def walk(current, path: tuple) -> None:
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                lines[path + (key.value,)] = key.start_mark.line + 1
                walk(value, path + (key.value,))
        elif isinstance(current, yaml.SequenceNode):
            for index, item in enumerate(current.value):
                lines[path + (index,)] = item.start_mark.line + 1
                walk(item, path + (index,))

    if node is not None:
        walk(node, ())
    return lines


def line_of(loc: tuple, lines: dict[tuple, int]) -> int | None:
    """The line of the deepest part of loc that the file has (pydantic adds type names)."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None

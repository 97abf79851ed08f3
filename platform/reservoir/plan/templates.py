"""Prompt templates: a format string over a data set's columns (tasks.prompt_template)."""

from __future__ import annotations

import string


def template_fields(template: str) -> list[str]:
    """The column names a prompt template fills; ValueError for anything but plain names
    (no attribute or index access, no format spec or conversion).

    >>> template_fields("{question}\\nAnswer:")
    ['question']
    """
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"{{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}}: a template names columns only "
                             "({column}), with no attributes, indexes or formats")
        names.append(name)
    return names

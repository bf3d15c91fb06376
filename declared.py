"""A dataclass as the one declaration of a JSON document or a set of options.

Each field is declared once, torchtitan-style: its name, its type annotation and, on
the line after it, a docstring saying what it holds. From that declaration come the
JSON types a reader checks (``json_types``, ``check_fields``), the field table of the
docs (``field_table``) and the help of a command-line option (``field_docs``).

Annotations are read as written (``from __future__ import annotations``): ``str``,
``int``, ``bool``, ``list``, ``dict`` (with or without their parameters), ``None``,
and ``Count`` (an integer >= 0, never a bool), joined by ``|``.
"""

from __future__ import annotations

import dataclasses
import functools

from moetrace.errors import MoetraceError

Count = int  # an integer >= 0, never a bool (checked as "count")

# JSON type name -> predicate on the parsed JSON value
_TYPES = {
    "str": lambda v: isinstance(v, str),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "bool": lambda v: isinstance(v, bool),
    "list": lambda v: isinstance(v, list),
    "dict": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}
_NAMES = {"str": "str", "int": "int", "Count": "count", "bool": "bool", "list": "list", "dict": "dict",
          "None": "null"}


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """{field name: its docstring, white space folded} of a dataclass, read from its source
    (a field without one maps to "")."""
    import ast  # here: the command line builds its options without reading any source
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a frozen build): help and tables go without
        return {f.name: "" for f in dataclasses.fields(cls)}
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:] + [None]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                         and isinstance(after.value.value, str)) else ""
            docs[node.target.id] = " ".join(text.split())
    return {f.name: docs.get(f.name, "") for f in dataclasses.fields(cls)}


def json_type(annotation: str) -> str:
    """``"Count | None"`` -> ``"count|null"``: the JSON types a field may hold."""
    names = []
    for part in str(annotation).split("|"):
        base = part.strip().split("[", 1)[0]
        if base not in _NAMES:
            raise TypeError(f"annotation {annotation!r}: {base!r} is not a JSON type ({', '.join(_NAMES)})")
        names.append(_NAMES[base])
    return "|".join(names)


@functools.lru_cache(maxsize=None)
def json_types(cls: type) -> dict[str, str]:
    """{field name: JSON types} of a dataclass that declares a document, in field order."""
    return {f.name: json_type(f.type) for f in dataclasses.fields(cls)}


def _type_name(v) -> str:
    if v is None:
        return "null"
    return {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list",
            dict: "an object"}.get(type(v), type(v).__name__)


def check_fields(doc, cls: type, where: str) -> dict:
    """`doc` if it is an object holding every field `cls` declares with one of its JSON
    types; else a one-line MoetraceError naming `where`, the key, what it holds and what
    was expected. Keys the declaration does not name are ignored."""
    if not isinstance(doc, dict):
        raise MoetraceError(f"{where}: is {_type_name(doc)}, expected a JSON object")
    for key, spec in json_types(cls).items():
        if key not in doc:
            raise MoetraceError(f"{where}: lacks the key {key!r} ({spec})")
        v = doc[key]
        if not any(_TYPES[t](v) for t in spec.split("|")):
            raise MoetraceError(f"{where}: {key!r} is {_type_name(v)} ({v!r:.60}), expected "
                                f"{spec.replace('|', ' or ')}")
    return doc


def field_table(cls: type) -> str:
    """The Markdown table of a declaration, one row per field: name, JSON types, docstring."""
    rows = ["| field | type | meaning |", "|-------|------|---------|"]
    docs, types = field_docs(cls), json_types(cls)
    for name in types:
        meaning = docs[name].replace("|", "\\|")  # a pipe inside a cell would end it
        rows.append(f"| `{name}` | {types[name].replace('|', ' or ')} | {meaning} |")
    return "\n".join(rows)

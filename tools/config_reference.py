"""The configuration reference, generated from the pydantic schemas: `docs/configuration.md`.

    python -m ucm.tools.config_reference > docs/configuration.md
    python -m ucm.tools.config_reference --check docs/configuration.md   # exit 1 if stale

Each section is one model: `SECTIONS` (ucm's own config) plus the `Options` model of every
built-in driver. A further model is one more `Section` line. An option's meaning is its
field's `description=`; where a driver's field has none, the comment beside the key in the
driver module's YAML example, or the comment on the field itself.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import io
import re
import sys
import tokenize
import types
import typing
from collections.abc import Set
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ByteSize, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

COMMAND = "python -m ucm.tools.config_reference > docs/configuration.md"
# Float options named like these are durations; ucm's config counts them in seconds.
_SECONDS = ("deadline", "latency", "timeout", "ttl", "backoff_base", "backoff_max", "wait")


@dataclass(frozen=True)
class Section:
    """One model in the reference. `model` is the class or a lazy "module:Attr.Attr" path;
    `prefix` is written before each key (e.g. "tiers[]." for a driver's options, which sit in
    the tier). `intro`: a paragraph under the title (default: the first paragraph of the
    model's module docstring, for driver sections)."""

    title: str
    model: type[BaseModel] | str
    prefix: str = ""
    intro: str | None = None


SECTIONS: list[Section] = [
    Section("The ucm config", "ucm.config:UCMConfig", "",
            "The top level of a config (YAML, JSON or a dict). A tier's keys other than "
            "`driver`, `name`, `capacity`, `codec`, `concurrency` and `options` are its "
            "driver's options (below). Unknown keys and bad values are errors naming the key."),
    Section("The vLLM connector", "ucm.vllm_hook.settings:HookOptions",
            "kv_connector_extra_config.",
            "The connector's own keys, beside `ucm` in vLLM's `kv_connector_extra_config`. "
            "Checked when the engine starts: an unknown key or a bad value is an error naming "
            "it."),
    Section("The SGLang backend", "ucm.sglang_hook.backend:StorageOptions",
            "hicache_storage_backend_extra_config.",
            "The keys of SGLang's `hicache_storage_backend_extra_config` for ucm's HiCache "
            "backend ([sglang.md](sglang.md)). Checked when SGLang builds the backend: an "
            "unknown key, a bad value or a missing `ucm` is an error naming it."),
]


def driver_sections() -> list[Section]:
    """One section per built-in driver, in the registry's order. An import that fails raises:
    the reference must cover every driver."""
    from ucm.drivers._registry import _BUILTIN

    sections = []
    for name, (target, extra) in _BUILTIN.items():
        module, _, cls = target.partition(":")
        model = resolve(f"{module}:{cls}.Options")
        intro = _module_intro(model)
        if extra:
            intro += f" Needs the `{extra}` extra (`pip install 'ucm[{extra}]'`)."
        sections.append(Section(f"Driver `{name}`", model, "tiers[].", intro))
    return sections


# -- rendering ----------------------------------------------------------------------------------
def render(sections: list[Section] | None = None) -> str:
    sections = SECTIONS + driver_sections() if sections is None else sections
    out = [
        "# Configuration reference",
        "",
        f"Generated from the pydantic schemas by `{COMMAND}`; do not edit by hand "
        "(`tests/test_config_reference.py` fails when it is out of date).",
        "",
        "Sizes take a unit (`512MiB`, `2GiB`) or a number of bytes; `null` is YAML's none; "
        "`[]` in a key means each item of a list.",
    ]
    for section in sections:
        model = resolve(section.model)
        intro = section.intro if section.intro is not None else _module_intro(model)
        out += ["", f"## {section.title}", ""]
        if intro:
            out += [intro, ""]
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        # A model that has a section of its own is not expanded again inside another.
        others = {resolve(s.model) for s in sections if s is not section}
        out += [_row(*row) for row in _rows(model, section.prefix, others)]
    return "\n".join(out) + "\n"


def resolve(model: type[BaseModel] | str) -> type[BaseModel]:
    if not isinstance(model, str):
        return model
    module_name, _, path = model.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in path.split("."):
        obj = getattr(obj, attr)
    if not (isinstance(obj, type) and issubclass(obj, BaseModel)):
        raise TypeError(f"{model} is not a pydantic model")
    return obj


def _rows(model: type[BaseModel], prefix: str, elsewhere: Set[type[BaseModel]] = frozenset(),
          ) -> list[tuple[str, str, str, str]]:
    rows = []
    notes = _source_notes(model)
    for name, field in model.model_fields.items():
        key = prefix + (field.alias or name)
        nested, many = _nested_model(field.annotation)
        rows.append((key, type_name(field.annotation, name, field),
                     _default(field), _meaning(field, notes.get(name, ""))))
        if nested is not None and nested.model_fields and nested not in elsewhere:
            rows += _rows(nested, key + ("[]." if many else "."), elsewhere)
    return rows


def _row(key: str, kind: str, default: str, meaning: str) -> str:
    cells = [f"`{key}`", kind, default, re.sub(r"<(?=[A-Za-z/])", "&lt;", meaning)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _meaning(field: FieldInfo, fallback: str) -> str:
    return " ".join((field.description or fallback).split())


def _nested_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model a field holds (directly, optionally, or as list items), and whether a list."""
    args = [a for a in _union_args(annotation) if a is not type(None)]
    if len(args) != 1:
        return None, False
    arg = args[0]
    if typing.get_origin(arg) is list:
        inner = typing.get_args(arg)[0]
        return (inner, True) if _is_model(inner) else (None, False)
    return (arg, False) if _is_model(arg) else (None, False)


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _union_args(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def type_name(annotation: Any, name: str = "", field: FieldInfo | None = None) -> str:
    """A readable type: "bytes (e.g. 2GiB)", "one of memory|local", "float seconds"."""
    args = _union_args(annotation)
    if len(args) > 1:
        parts = [type_name(a, name) for a in args if a is not type(None)]
        text = " or ".join(parts) + (" or null" if type(None) in args else "")
    else:
        text = _one_type(annotation, name)
    bounds = _bounds(field) if field is not None else ""
    return f"{text}, {bounds}" if bounds else text


def _one_type(tp: Any, name: str) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + "|".join(str(v) for v in typing.get_args(tp))
    if origin is list:
        return f"list of {_one_type(typing.get_args(tp)[0], name)}"
    if origin is dict:
        return "mapping"
    if isinstance(tp, type):
        if issubclass(tp, ByteSize):
            return "bytes (e.g. 2GiB)"
        if issubclass(tp, BaseModel):
            return "mapping"
        if issubclass(tp, SecretStr):
            return "secret string"
        if issubclass(tp, Enum):
            return "one of " + "|".join(str(m.value) for m in tp)
        if issubclass(tp, bool):
            return "bool"
        if issubclass(tp, int):
            return "int"
        if issubclass(tp, float):
            return "float seconds" if _is_duration(name) else "float"
        if issubclass(tp, str):
            return "string"
        if issubclass(tp, Path):
            return "path"
    return str(tp)


def _is_duration(name: str) -> bool:
    return any(name == s or name.endswith("_" + s) for s in _SECONDS)


_BOUND_SIGNS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"),
                ("min_length", "length >="), ("max_length", "length <="))


def _bounds(field: FieldInfo) -> str:
    found = []
    for meta in field.metadata:
        for attr, sign in _BOUND_SIGNS:
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{sign} {_bytes_text(value, field)}")
    return ", ".join(found)


def _bytes_text(value: Any, field: FieldInfo) -> str:
    sized = any(isinstance(a, type) and issubclass(a, ByteSize)
                for a in _union_args(field.annotation))
    return _size(int(value)) if sized and isinstance(value, int) and value else str(value)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.get_default(call_default_factory=True)
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return _value_text(value)


def _value_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        return _size(int(value))
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def _size(n: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


# -- meanings from the source, for fields without description= ----------------------------------
def _source_notes(model: type[BaseModel]) -> dict[str, str]:
    """Per field name: the comment beside the key in the YAML example of the module that
    defines the model, else the comment or docstring on the field in the class body."""
    notes: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if _is_model(cls) and cls is not BaseModel:
            notes.update(_class_notes(cls))
    module = sys.modules.get(model.__module__)
    doc = inspect.getdoc(module) if module is not None else None
    notes.update(_example_notes(doc or ""))
    return notes


def _example_notes(doc: str) -> dict[str, str]:
    """`key: value  # comment` lines of a docstring's YAML examples; the first one per key."""
    notes: dict[str, str] = {}
    for line in doc.splitlines():
        match = re.match(r"\s+(?:- )?([a-z_]+): .*?\s#\s*(.+)$", line)
        if match:
            notes.setdefault(match.group(1), match.group(2).strip())
    return notes


def _class_notes(cls: type) -> dict[str, str]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    source = inspect.cleandoc("\n" + source) if source[:1].isspace() else source
    tree = ast.parse(source)
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    comments: dict[int, str] = {}
    own_line: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
            if not tok.line[:tok.start[1]].strip():
                own_line.add(tok.start[0])
    notes = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        after = body[i + 1] if i + 1 < len(body) else None
        end = node.end_lineno if node.end_lineno is not None else node.lineno
        beside = [comments[n] for n in range(node.lineno, end + 1)
                  if n in comments and n not in own_line]
        above: list[str] = []
        line = node.lineno - 1
        while line in own_line:
            above.insert(0, comments[line])
            line -= 1
        if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            text = after.value.value
        else:
            text = " ".join(beside or above)
        if text:
            notes[node.target.id] = " ".join(text.split())
    return notes


def _module_intro(model: type[BaseModel]) -> str:
    module = sys.modules.get(model.__module__)
    doc = inspect.getdoc(module) if module is not None else None
    return " ".join(doc.split("\n\n")[0].split()) if doc else ""


# -- command line -------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ucm.tools.config_reference",
                                     description="Prints the configuration reference (Markdown).")
    parser.add_argument("--check", metavar="PATH",
                        help="exit 1 when PATH differs from what would be generated")
    args = parser.parse_args(argv)
    text = render()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.check)
    current = path.read_text() if path.exists() else None
    if current != text:
        print(f"{path} is out of date: run {COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

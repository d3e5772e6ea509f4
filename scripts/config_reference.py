"""The configuration reference (docs/configuration.md), generated from the config dataclasses' source: every key with
its type, default and meaning, the meaning being the comment on the field's line and the comment lines right above
it. So the docs hold no second copy of what a key means; tests/test_docs.py fails when a key has none.

MkDocs runs this file as a hook (mkdocs.yml): the page's ``<!-- config-reference -->`` marker becomes the tables.
It reads the source files rather than importing them, so building the docs imports neither torch nor Ray."""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sbert_ray"
SOURCES = [PACKAGE / "config" / "schema.py", PACKAGE / "tuning" / "space.py", PACKAGE / "models" / "lora_settings.py"]
MARKER = "<!-- config-reference -->"
# (heading, root class); nested dataclass fields get their own tables below their parent's.
DOCUMENTS = [("Training config (`sbert-ray train`)", "TrainConfig"), ("Sweep config (`sbert-ray tune`)", "SweepConfig")]


@dataclass
class Field:
    name: str
    type: str
    default: str
    meaning: str
    nested: str | None  # the dataclass this field holds (for `list[StageConfig]` too), else None


@dataclass
class Section:
    name: str
    doc: str
    fields: list[Field]


def sections() -> dict[str, Section]:
    """Every dataclass of the config sources, by class name."""
    found: dict[str, Section] = {}
    for path in SOURCES:
        source = path.read_text()
        comments = {token.start[0]: token.string for token in _tokens(source) if token.type == tokenize.COMMENT}
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.ClassDef) and any(_is_dataclass(d) for d in node.decorator_list):
                found[node.name] = Section(node.name, ast.get_docstring(node) or "", [])
                for statement in node.body:
                    if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                        found[node.name].fields.append(_field(statement, comments, lines))
    known = set(found)
    for section in found.values():
        for f in section.fields:
            f.nested = next((name for name in known if f.type in (name, f"list[{name}]", f"{name} | None")), None)
    return found


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Name) and target.id == "dataclass"


def _field(statement: ast.AnnAssign, comments: dict[int, str], lines: list[str]) -> Field:
    above, line = [], statement.lineno - 1
    while line >= 1 and line in comments and lines[line - 1].lstrip().startswith("#"):
        above.insert(0, comments[line])
        line -= 1
    trailing = [comments[statement.end_lineno]] if statement.end_lineno in comments else []
    meaning = " ".join(c.lstrip("#").strip() for c in above + trailing)
    kind = _segment(lines, statement.annotation)
    return Field(statement.target.id, kind, _default(statement.value, lines), meaning, None)


def _segment(lines: list[str], node: ast.expr) -> str:
    """The source text of ``node``, as ``ast.get_source_segment`` gives it, from the lines split once: that function
    splits the whole source again on every call, which made reading the config sources take ~40 s on 2 cores."""
    text = [line.encode() for line in lines[node.lineno - 1 : node.end_lineno]]  # AST offsets count UTF-8 bytes
    text[-1] = text[-1][: node.end_col_offset]
    text[0] = text[0][node.col_offset :]
    return "\n".join(line.decode() for line in text)


def _default(value: ast.expr | None, lines: list[str]) -> str:
    """The default as the source writes it (YAML's spelling of None, True, False); ``field(default_factory=...)``
    as the value the factory makes."""
    if value is None:
        return "required"
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        factory = next(k.value for k in value.keywords if k.arg in ("default_factory", "default"))
        if isinstance(factory, ast.Lambda):
            factory = factory.body
        if isinstance(factory, ast.Name):
            return {"dict": "{}", "list": "[]"}.get(factory.id, "(below)")
        if isinstance(factory, ast.List) and factory.elts and isinstance(factory.elts[0], ast.Call):
            return "one stage (below)"
        return _segment(lines, factory)
    text = _segment(lines, value)
    return {"None": "null", "True": "true", "False": "false"}.get(text, text)


def keys(root: str, prefix: str = "") -> list[tuple[str, Field]]:
    """(dotted key, field) for every key under ``root``, containers included (``model``, ``stages``)."""
    found = []
    for f in sections()[root].fields:
        found.append((f"{prefix}{f.name}", f))
        if _documented_below(f):
            found += keys(f.nested, _child_prefix(prefix, f))
    return found


def _documented_below(f: Field) -> bool:
    return f.nested is not None and f.nested != "TrainConfig"  # a sweep's `base` is the training config above


def _child_prefix(prefix: str, f: Field) -> str:
    return f"{prefix}{f.name}.N." if f.type.startswith("list[") else f"{prefix}{f.name}."


def undocumented() -> list[str]:
    """Keys whose field has no comment."""
    return [key for _, root in DOCUMENTS for key, f in keys(root) if not f.meaning]


def reference_markdown() -> str:
    all_sections, parts = sections(), []
    for heading, root in DOCUMENTS:
        parts.append(f"## {heading}\n")
        parts += _tables(all_sections, root, "")
    return "\n".join(parts)


def _tables(all_sections: dict[str, Section], name: str, prefix: str) -> list[str]:
    section = all_sections[name]
    title = f"### `{prefix.rstrip('.')}`\n" if prefix else ""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for f in section.fields:
        default = "the training config above" if f.nested == "TrainConfig" else f.default
        # Pipes inside code spans do not split a table row (and a backslash there would show).
        rows.append(f"| `{prefix}{f.name}` | `{f.type}` | `{default}` | {_html(_cell(f.meaning))} |")
    parts = [title + (f"\n{section.doc}\n\n" if section.doc and prefix else "\n") + "\n".join(rows) + "\n"]
    for f in section.fields:
        if _documented_below(f):
            parts += _tables(all_sections, f.nested, _child_prefix(prefix, f))
    return parts


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _html(text: str) -> str:
    """Comments say <storage_path>/<name>: shown as written, not read as HTML tags."""
    return text.replace("<", "&lt;").replace(">", "&gt;")


def on_page_markdown(markdown: str, page, config, files) -> str:  # the MkDocs hook
    return markdown.replace(MARKER, reference_markdown()) if MARKER in markdown else markdown


if __name__ == "__main__":
    print(reference_markdown())

"""YAML as configs are read: ``yaml.safe_load`` refusing a key given twice and aliases that expand the document
past ``MAX_YAML_VALUES`` values or into themselves; errors on one line."""

from __future__ import annotations

from typing import Any

import yaml

MAX_YAML_VALUES = 100_000  # a config holds hundreds; nested aliases can make a 2 KB file expand to billions


class ConfigLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader with two refusals: a key given twice in one mapping (YAML requires unique keys;
    PyYAML silently keeps the last), and aliases that expand the document past MAX_YAML_VALUES values or into
    themselves (PyYAML shares the aliased objects, but every walk over the config visits each use)."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {})
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue  # merged keys may be overridden; a non-scalar key is refused by PyYAML itself
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first on line {first_line[key]})", key_node.start_mark
                )
            first_line[key] = line
        return super().construct_mapping(node, deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int | None]) -> int:
    """How many values ``node`` holds with every alias expanded; each node is counted once (``sizes``), so a bomb
    is refused in time linear in the file."""
    if id(node) in sizes:
        if sizes[id(node)] is None:
            raise yaml.composer.ComposerError(None, None, "an alias refers to a value that holds it", node.start_mark)
        return sizes[id(node)]
    sizes[id(node)] = None  # being counted: meeting it again below is a cycle
    children = node.value if isinstance(node, yaml.SequenceNode) else ()
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    size = 1 + sum(_expanded_size(child, sizes) for child in children)
    if size > MAX_YAML_VALUES:
        raise yaml.composer.ComposerError(
            None, None, f"aliases expand this value past {MAX_YAML_VALUES:,} values", node.start_mark
        )
    sizes[id(node)] = size
    return size


def parse_yaml(text: str) -> Any:
    """One YAML document read by ``ConfigLoader``."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)


def yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and at which line (PyYAML's own text spans several)."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"line {mark.line + 1}: {problem}" if mark else problem

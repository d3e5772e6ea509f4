"""Property tests: whatever a user writes in a config, an override or a data file, the answer is a valid result or
an error that says where (the config key; the file and line), never any other exception."""

from __future__ import annotations

import dataclasses
import json
import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from sbert_ray.config import ConfigError, TrainConfig, flatten, load_config, to_dict
from sbert_ray.data import NLI_LABELS, DataError, read_user_file
from sbert_ray.data.readers import read_stsb
from sbert_ray.data.records import RECORD_TYPES

# No time limits: on a loaded 2-core machine one draw can take seconds (the first imports the config's objective
# registry, hence torch), which says nothing about the property under test.
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# --- configs ----------------------------------------------------------------------------------------------

DEFAULTS = flatten(to_dict(TrainConfig()))
KNOWN_KEYS = sorted(DEFAULTS)
EXTRA_KEYS = [
    "stages.1.dataset",
    "stages.2.learning_rate",
    "stages.0.columns.sentence1",
    "stages.0.concat.0",
    "stages.0.concat.5",
    "evaluation.final_tasks.0",
    "name.x",
    "model.name.inner",
    "model",
    "stages",
    "stages.x.epochs",
    "unknown",
    "scaling.unknown",
    "stages.0.unknown",
]
wild_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2, 16, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([0.0, -0.5, 0.5, 1e-5, float("nan"), float("inf"), -float("inf")])
    | st.text(max_size=20)
    | st.sampled_from(["stsb", "mean", "regression", "softmax", "u", "|u-v|", "2e-5", "1e400", "nan"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)


def values_for(key: str) -> st.SearchStrategy:
    """Mostly values of the key's own type near its default (so that many configs are valid and the checks
    between keys are reached), sometimes anything at all."""
    default = DEFAULTS.get(key)
    if isinstance(default, bool):
        near = st.booleans()
    elif isinstance(default, int):
        near = st.integers(min_value=-3, max_value=64) | st.sampled_from([0, 10**30])
    elif isinstance(default, float):
        near = st.floats(min_value=1e-7, max_value=1.0) | st.floats(allow_nan=True, allow_infinity=True)
    else:
        near = st.just(default)
    return st.one_of(near, near, near, wild_values)


keys = st.sampled_from(KNOWN_KEYS + EXTRA_KEYS) | st.text(alphabet=string.ascii_lowercase + "._0123456789", max_size=20)
key_values = keys.flatmap(lambda key: st.tuples(st.just(key), values_for(key) | st.text(max_size=12)))


def yaml_text(value) -> str:
    """How a user would type the value on the command line (flow style, one line)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


def named_keys(keys_given: list[str]) -> set[str]:
    """Every dotted prefix of the keys (an error about `name.x=1` may name `name`)."""
    return {".".join(key.split(".")[: n + 1]) for key in keys_given for n in range(len(key.split(".")))}


def assert_valid_or_names_a_key(path, overrides: list[str], keys_given: list[str]) -> None:
    try:
        config = load_config(path, overrides)
    except ConfigError as error:
        message = str(error)
        named = named_keys(keys_given) | {repr(item) for item in overrides}  # a malformed override is quoted whole
        assert any(key and key in message for key in named), message
        event("ConfigError")
    else:
        event("valid config")
        assert isinstance(config, TrainConfig)
        config.validate()


@SETTINGS
@given(st.lists(key_values, min_size=1, max_size=3))
def test_overrides_give_a_valid_config_or_an_error_naming_the_key(pairs) -> None:
    overrides = [f"{key}={value if isinstance(value, str) else yaml_text(value)}" for key, value in pairs]
    assert_valid_or_names_a_key(None, overrides, [key for key, _ in pairs])


@SETTINGS
@given(
    st.lists(
        st.sampled_from(KNOWN_KEYS + EXTRA_KEYS).flatmap(lambda k: st.tuples(st.just(k), values_for(k))),
        min_size=1,  # an empty file is refused as such (test_reliability.py::test_configs_that_trained_silently...)
        max_size=4,
    )
)
def test_yaml_files_give_a_valid_config_or_an_error_naming_the_key(tmp_path, pairs) -> None:
    flat = dict(pairs)
    raw: dict = {}
    for key, value in flat.items():  # nest a.b.c: v, treating numeric parts as mapping keys (YAML reads them so)
        node = raw
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[last] = value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert_valid_or_names_a_key(path, [], list(flat))


# --- data files -------------------------------------------------------------------------------------------

SCORE_RANGE = (0.0, 5.0)
plain_text = st.text(alphabet=string.ascii_letters + " ,'", min_size=1, max_size=20).filter(str.strip)
tricky_text = st.text(max_size=30) | st.sampled_from(
    ['"', '""', 'a "b" c', "a,b", "a\tb", "x\r\ny", "\r", "\n", "caf\udcff", " ", "", "w" * 131_073, "w" * 200_000]
)
odd_values = st.sampled_from([-1, 5.0001, 100, "3.5", "nan", "inf", "1e400", "high", True, False, None, [1], {"a": 1}])
CELLS = {
    "score": st.one_of(*[st.floats(0, 5)] * 5, odd_values),
    "label": st.one_of(st.sampled_from(NLI_LABELS), st.sampled_from(NLI_LABELS), st.sampled_from(["maybe", 1])),
}
TEXT_CELL = st.one_of(*[plain_text] * 8, tricky_text, odd_values)
line_ends = st.sampled_from(["\n", "\r\n", "\r"])
junk_bytes = st.one_of(
    st.just(b""),
    st.just(b""),
    st.sampled_from([b"\xff\xfe", b"\xe9", b"\xc3", b"\x00", b"\xef\xbb\xbf", b'"']),
    st.binary(max_size=8),
)


@st.composite
def table_rows(draw, header: list[str]) -> list[list]:
    """Rows of mostly the right width with mostly plain cells; some cells, widths and values are wrong."""
    rows = []
    for _ in range(draw(st.integers(0, 6))):
        row = [draw(CELLS.get(name, TEXT_CELL)) for name in header]
        if draw(st.integers(0, 9)) == 0:
            row = row[: draw(st.integers(0, len(row)))] + draw(st.lists(plain_text, max_size=2))
        rows.append(row)
    return rows


def render(fmt: str, header: list[str], body: list[list], line_end: str) -> str:
    if fmt == "jsonl":
        return line_end.join(json.dumps(dict(zip(header, row, strict=False))) for row in body)
    sep = "," if fmt == "csv" else "\t"
    lines = [sep.join(header)] + [sep.join(str(cell) for cell in row) for row in body]
    return line_end.join(lines)


def check_read(read, path: Path, errors: str, score_range=None) -> None:
    try:
        records = read(path, errors)
    except DataError as error:
        message = str(error)
        assert message.startswith(f"{path}, line ") or message.startswith(f"{path}: empty file"), message
        event("DataError: " + message.removeprefix(str(path)).split(":")[1].split("(")[0].strip()[:25])
        return
    event(f"records ({errors}): {'some' if records else 'none'}")
    for record in records:
        score = getattr(record, "score", None)
        if score is not None and score_range:
            assert score_range[0] <= score <= score_range[1]
        for value in (getattr(record, name) for name in record.__slots__):
            if isinstance(value, str):
                assert value.strip() and value.encode("utf-8")


@SETTINGS
@given(data=st.data(), fmt=st.sampled_from(["csv", "tsv", "jsonl"]), kind=st.sampled_from(list(RECORD_TYPES)))
def test_user_files_give_records_or_an_error_naming_file_and_line(tmp_path, data, fmt, kind) -> None:
    header = [field.name for field in dataclasses.fields(RECORD_TYPES[kind])]
    body = data.draw(table_rows(header))
    content = render(fmt, header, body, data.draw(line_ends)).encode("utf-8", "surrogateescape")
    junk_at = data.draw(st.integers(0, len(content)))
    path = tmp_path / f"data.{fmt}"
    path.write_bytes(content[:junk_at] + data.draw(junk_bytes) + content[junk_at:])
    errors = data.draw(st.sampled_from(["raise", "skip"]))
    check_read(lambda p, e: read_user_file(p, kind, errors=e, score_range=SCORE_RANGE), path, errors, SCORE_RANGE)


STSB_FIELDS = ["genre", "filename", "year", "id", "score", "sentence1", "sentence2"]


@SETTINGS
@given(data=st.data())
def test_stsb_files_give_records_or_an_error_naming_file_and_line(tmp_path, data) -> None:
    body = data.draw(table_rows(STSB_FIELDS))
    content = render("tsv", STSB_FIELDS, body, data.draw(line_ends)).encode("utf-8", "surrogateescape")
    content = content[content.index(b"\n") + 1 :] if b"\n" in content else b""  # STSb files have no header
    junk_at = data.draw(st.integers(0, len(content)))
    path = tmp_path / "sts-train.csv"
    path.write_bytes(content[:junk_at] + data.draw(junk_bytes) + content[junk_at:])
    check_read(read_stsb, path, "raise", SCORE_RANGE)  # STSb scores are 0-5 too
    check_read(read_stsb, path, "skip", SCORE_RANGE)


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_the_generators_reach_valid_files(tmp_path, fmt) -> None:
    """The property tests above are not vacuous: a well-formed file of the same shape reads to records."""
    path = tmp_path / f"ok.{fmt}"
    path.write_text(render(fmt, ["sentence1", "sentence2", "score"], [["a", "b", 2.5], ["c", "d", 5]], "\n"))
    records = read_user_file(path, "scored", score_range=SCORE_RANGE)
    assert [r.score for r in records] == [2.5, 5.0]

"""The config loader under random and mutated input: a config is either valid or refused
with a ConfigError naming its problems, never a traceback of another kind."""

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from disttrain.config import Config, config_from_dict, load_config
from disttrain.config.schema import SECTIONS
from disttrain.core.errors import ConfigError

KNOWN_KEYS = [f"{section}.{name}" for section, kind in SECTIONS.items()
              for name in kind.__dataclass_fields__]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.binary(max_size=8))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6)
keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=25))


def sections_of(flat: dict[str, object]) -> dict[str, object]:
    nested: dict[str, object] = {}
    for dotted, value in flat.items():
        section, _, name = dotted.partition(".")
        holder = nested.setdefault(section, {})
        if isinstance(holder, dict) and name:
            holder[name] = value
        else:
            nested[section] = value
    return nested


def accepted_or_refused(build) -> None:
    try:
        config = build()
    except ConfigError as e:
        assert e.problems and all(isinstance(p, str) and p for p in e.problems)
        return
    assert isinstance(config, Config)
    assert config.training.batch_size > 0 and math.isfinite(config.training.learning_rate)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=6))
@example({"training.batch_size": float("nan")})
@example({"training.learning_rate": float("inf")})
@example({"training": None})
@example({"system.num_workers": 2**70})
def test_random_mappings_are_valid_or_refused_with_a_config_error(flat):
    accepted_or_refused(lambda: config_from_dict(sections_of(flat)))


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=8), st.lists(st.text(max_size=30), max_size=4))
def test_thousands_of_mappings_and_set_expressions(flat, expressions):
    accepted_or_refused(lambda: config_from_dict(sections_of(flat)))
    accepted_or_refused(lambda: load_config(None, None, expressions))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=4))
@example(["training.batch_size=[1, 2]"])
@example(["training.learning_rate=.nan"])
@example(["training.seed=!!python/object:os.system"])
@example(["=1", ".=", "a.b.c=1"])
def test_random_set_expressions_are_valid_or_refused_with_a_config_error(expressions):
    accepted_or_refused(lambda: load_config(None, None, expressions))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200)))
@example("training: [1, 2")
@example("!!python/object/apply:os.system ['true']")
@example(b"\xff\xfe\x00")
def test_random_config_files_are_valid_or_refused_with_a_config_error(tmp_path_factory, content):
    path = tmp_path_factory.mktemp("config") / "config.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    accepted_or_refused(lambda: load_config(path))


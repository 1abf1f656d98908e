"""A step's runtime env: Ray's format, refused at parse time in the user's words, merged as Ray merges."""

from __future__ import annotations

import pytest

from rayslice.core import runtime_env
from rayslice.core.exceptions import InvalidRequestError


def test_rays_own_keys_pass_through_unchanged():
    env = {"working_dir": "./program", "py_modules": ["./lib", "gcs://_ray_pkg_ab.zip"], "pip": ["tqdm==4.66.0"],
           "env_vars": {"XLA_FLAGS": "--xla_dump_to=/tmp"}, "excludes": ["*.ckpt"], "config": {"eager_install": True}}
    assert runtime_env.validate(env) == env
    assert runtime_env.validate(None) is None


def test_an_unknown_key_is_refused_naming_the_valid_ones():
    with pytest.raises(InvalidRequestError, match=r"unknown key\(s\) 'workdir'; valid keys: working_dir, py_modules"):
        runtime_env.validate({"workdir": "."})


@pytest.mark.parametrize(("env", "fragment"), [
    ({"env_vars": {"STEPS": 100}}, "\\['env_vars'\\] must be a dict of variable names to string values"),
    ({"py_modules": "./lib"}, "\\['py_modules'\\] must be a list"),
    ({"pip": 3}, "\\['pip'\\] must be a list of requirements"),
    ({"pip": ["a"], "uv": ["b"]}, "'pip' or 'uv', not both"),
    ({"working_dir": ""}, "\\['working_dir'\\] must be a local folder"),
    ("./program", "must be a dict in Ray's runtime_env format"),
])
def test_wrong_types_are_refused_with_what_the_key_takes(env, fragment):
    with pytest.raises(InvalidRequestError, match=fragment):
        runtime_env.validate(env, "runtime_env of 'train'")


def test_templated_values_wait_for_rendering():
    env = {"env_vars": {"RUN": "{{ run_id }}"}, "working_dir": "{{ params.code }}"}
    assert runtime_env.validate(env) == env


def test_a_connections_default_merges_under_the_tasks_own():
    default = {"pip": ["numpy"], "env_vars": {"A": "1", "B": "1"}}
    task = {"working_dir": "./program", "env_vars": {"B": "2"}}
    assert runtime_env.merge(default, task) == {"pip": ["numpy"], "working_dir": "./program",
                                                "env_vars": {"A": "1", "B": "2"}}
    assert runtime_env.merge(None, None) is None
    assert runtime_env.merge(default, None) == default


def test_only_local_paths_are_uploaded():
    env = {"working_dir": "./program", "py_modules": ["./lib", "s3://bucket/lib.zip"]}
    assert runtime_env.local_paths(env) == ["./program", "./lib"]

"""A `ray` connection that lists other connections is a cluster set (hooks/ray.py `cluster_set_of`)."""

from __future__ import annotations

import json

import pytest
from airflow.sdk import Connection
from rayslice.hooks.ray import cluster_set_of, settings_from_connection

from rayslice.core.exceptions import InvalidRequestError


def conn(extra: dict, **fields) -> Connection:
    return Connection(conn_id="tpu_anywhere", conn_type="ray", extra=json.dumps(extra), **fields)


def test_a_connection_listing_clusters_is_a_set_in_their_order():
    clusters = cluster_set_of(conn({"clusters": ["ray_east", "ray_west"], "checkpoint_root": "gs://b/ckpt"}))
    assert clusters is not None and clusters.members == ("ray_east", "ray_west")
    assert clusters.name == "tpu_anywhere" and clusters.checkpoint_root == "gs://b/ckpt" and not clusters.shared_root


def test_a_comma_separated_list_from_a_form_reads_the_same():
    assert cluster_set_of(conn({"clusters": "ray_east, ray_west"})).members == ("ray_east", "ray_west")


def test_a_plain_connection_is_no_set():
    assert cluster_set_of(Connection(conn_id="r", conn_type="ray", host="http://h:8265")) is None


@pytest.mark.parametrize(("extra", "fields", "says"), [
    ({"clusters": ["only_one"]}, {}, "two or more"),
    ({"clusters": ["a", "a"]}, {}, "each member connection once"),
    ({"clusters": ["a", "tpu_anywhere"]}, {}, "not itself"),
    ({"clusters": ["a", "b"], "team": "research"}, {}, "the extras team, which belong on its member connections"),
    ({"clusters": ["a", "b"]}, {"host": "http://h:8265"}, "a host"),
    ({"clusters": ["a", "b"], "shared_root": "yes"}, {}, "true or false"),
    ({"shared_root": True}, {"host": "http://h:8265"}, "only a cluster set reads it"),
    ({"clusters": ["a", "b"], "checkpoint_root": "relative/ckpt"}, {}, "checkpoint_root"),
])
def test_a_bad_set_is_refused_naming_what_is_wrong(extra, fields, says):
    with pytest.raises(InvalidRequestError, match=says):
        cluster_set_of(conn(extra, **fields))


def test_a_set_is_refused_where_one_cluster_is_needed_naming_its_members():
    with pytest.raises(InvalidRequestError, match="is a cluster set \\(ray_east, ray_west\\).*name one of the member"):
        settings_from_connection(conn({"clusters": ["ray_east", "ray_west"]}))

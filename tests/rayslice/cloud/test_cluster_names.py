"""A RayCluster name per DAG run: valid for KubeRay, one per run (and per Airflow), refused bad names."""

from __future__ import annotations

import pytest

from rayslice.cloud import kuberay
from rayslice.cloud.cluster_names import PER_RUN, check_name, per_run_name, resolve_name
from rayslice.core.exceptions import InvalidRequestError


@pytest.mark.parametrize("dag_id", ["train", "My_DAG.v2", "x" * 250, "_", "9lives", "ünïcode-dag"])
def test_a_per_run_name_is_a_short_valid_raycluster_name(dag_id):
    name = per_run_name(dag_id, "manual__2026-01-01T00:00:00+00:00", "prod")
    kuberay._check_name(name, "RayCluster")  # KubeRay's own rule (DNS-1035, <= 53)
    assert len(name) <= 40 and name.startswith("rs-")


def test_each_run_and_each_airflow_gets_its_own_name_and_the_same_one_every_time():
    a = per_run_name("train", "manual__1", "prod")
    assert a == per_run_name("train", "manual__1", "prod")  # the setup, each step and the teardown agree
    assert len({a, per_run_name("train", "manual__2", "prod"), per_run_name("train", "manual__1", "staging"),
                per_run_name("train2", "manual__1", "prod")}) == 4


def test_resolve_name():
    assert resolve_name(None, "d", "r") is None and resolve_name("", "d", "r") is None
    assert resolve_name("rayslice", "d", "r") == "rayslice"
    assert resolve_name(PER_RUN, "d", "r", "prod") == per_run_name("d", "r", "prod")


@pytest.mark.parametrize("bad", ["Train", "run_1", "1run", "a" * 54, "", "rs-", 7])
def test_bad_names_are_refused_in_the_arguments_words(bad):
    with pytest.raises(InvalidRequestError, match=r"kuberay_cluster of 't' .* is invalid: a RayCluster name is a "
                                                  r"DNS-1035 label of at most 53 characters"):
        check_name(bad, "kuberay_cluster of 't'")

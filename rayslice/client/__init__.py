"""Airflow side: reaching a Ray cluster over HTTP (Jobs API, dashboard state API).

Runs in Airflow workers, triggerers and the UI, and in the CLI; never imports ray or jax,
and is not shipped to the cluster.
"""

"""Airflow provider metadata, read through the `apache_airflow_provider` entry point."""

from __future__ import annotations


def get_provider_info() -> dict:
    return {
        "package-name": "rayslice",
        "name": "rayslice",
        "description": "Run accelerator steps (TPU slices, GPU fractions) on Ray.",
        "versions": ["0.1.0"],
        "connection-types": [],
    }

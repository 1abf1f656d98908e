"""Cloud control planes: KubeRay manifests and client, the Cloud TPU API.

Airflow side and laptop; their clients are optional extras (`kubernetes`, `gcp`), imported lazily.
"""

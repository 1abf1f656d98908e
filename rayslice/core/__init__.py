"""Both sides: the request model, the step as it travels, errors, the step context.

Imported by the Airflow side and shipped to the cluster; imports neither ray, jax, airflow nor httpx.
"""

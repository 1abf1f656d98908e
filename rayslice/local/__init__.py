"""Laptop only: the local simulated cluster, its autoscaler, the local Airflow, the demo.

Never runs in production Airflow or on a real cluster; may import anything.
"""

"""rayslice: accelerator steps of Airflow pipelines on Ray."""

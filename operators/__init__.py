"""Reservoir's operator library (installed as reservoir.operators); filled by the pipeline issue."""

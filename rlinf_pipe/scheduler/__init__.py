"""Placement, cluster, workers and worker groups."""

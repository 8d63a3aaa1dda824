"""Watching a run: per-step metrics, throughput and memory, profiler traces, experiment trackers."""

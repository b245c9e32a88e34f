"""One rank of a run: the worker's frame (`worker`: warnings, signals, errors reported once), the training loop,
the model it builds, resuming and saving, progress and TensorBoard output, and what a rank shares with the launcher:
the run directory, heartbeats and stack dumps, signal handling, timeline events.

May import `settings` and `checks`; never `launcher` (the launcher imports this subpackage, not the reverse).
"""

"""The pipeline, one file per stage: capture -> fuse -> prepare -> calibrate -> convert -> lower or
delegate -> finish (see docs/code-map.md). The public entry points are in :mod:`.steps`."""

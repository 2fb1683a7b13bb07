"""qplug-tiny-conv: the fusion example of docs/plugins/writing-a-backend.md."""

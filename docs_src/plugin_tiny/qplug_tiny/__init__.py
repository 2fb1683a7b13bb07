"""qplug-tiny: the backend built in docs/plugins/writing-a-backend.md."""

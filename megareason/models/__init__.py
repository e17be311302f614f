"""Models: offline provisioning of named checkpoints and tiny random checkpoints for tests."""

"""The `credproxy run` process: configuration, wiring, serving, workers."""

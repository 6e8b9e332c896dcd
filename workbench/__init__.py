"""EAGLE-3 speculative decoding workbench: capture, train, inspect, serve, experiment, report."""

__version__ = "0.1.0"

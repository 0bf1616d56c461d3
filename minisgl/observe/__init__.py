"""Observability: spans and Chrome traces, terminal timelines, benchmarks and the lab."""

"""Serving: the orchestrator, its router and worker registry, the launcher and worker entry points."""

"""The hardening tests: a package so that its conftest's servers are package-scoped."""

"""Findings: what the records say beyond the verdict — where the memory goes (OOM anatomy, the memory model
per flag set), what binds, and the file and line a fix would touch (the OOM site). Pure functions only."""

"""Scheduling: pure Python, no torch. The scheduler emits a plan; the engine runs it."""

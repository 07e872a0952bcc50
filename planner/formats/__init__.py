"""Formats: the Plan, per-layer profiles and their readers, row slicing, atomic file writes."""

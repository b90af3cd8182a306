"""Supervision layer: one control loop, one state vocabulary, explicit transitions, restart policy."""

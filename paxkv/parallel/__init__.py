"""Meshes and processes: the ("data", "model") mesh, and multi-host start-up and agreement."""

"""Topologies, meshes, ahead-of-time lowering and compilation, and artifacts."""

"""Distributed building blocks: the mesh, collectives and parallel layers."""

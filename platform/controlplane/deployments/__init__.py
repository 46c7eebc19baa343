"""Deployments: which nodes run a model, in which roles, with which settings."""

"""Helpers that more than one stage (or a stage and the runner) use: stages never import each other."""

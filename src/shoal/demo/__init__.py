"""`shoal demo`: one agent, many conversations at once, each in its own copy of a sample project."""

"""The sample project's package."""

"""What crosses the router/worker boundary: torch-free typed records, imported by the router
and the workers alike."""

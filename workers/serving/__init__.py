"""The worker's serving shell around one engine: its role, the KV handoff and migration verbs,
prefix fetches, and the dispatch of the router's calls."""

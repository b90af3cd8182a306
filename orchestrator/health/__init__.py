"""Health layer: heartbeats received from tasks (server) and what they say (store)."""

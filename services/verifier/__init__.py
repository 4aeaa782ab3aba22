"""The target verifier service (see server.py)."""

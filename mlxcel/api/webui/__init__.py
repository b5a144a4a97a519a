"""The chat page served at / (routes.py) and its static files."""

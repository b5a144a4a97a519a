"""The HTTP surface: Litestar routes that parse requests into engine types and back."""

"""kvstore.plugins."""

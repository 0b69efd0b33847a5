"""kvstore.scheduler."""

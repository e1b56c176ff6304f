"""memtrack."""

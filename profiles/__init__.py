"""mpfa package."""

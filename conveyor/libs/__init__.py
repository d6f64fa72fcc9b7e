"""Library code shared by two or more services."""

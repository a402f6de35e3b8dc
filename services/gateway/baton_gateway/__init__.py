"""baton_gateway (see ../shared/DESIGN.md)."""

"""baton_decode (see ../shared/DESIGN.md)."""

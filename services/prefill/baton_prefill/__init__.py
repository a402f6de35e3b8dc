"""baton_prefill (see ../shared/DESIGN.md)."""

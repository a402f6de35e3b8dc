"""baton_kvstore (see ../shared/DESIGN.md)."""

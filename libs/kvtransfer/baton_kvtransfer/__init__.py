"""baton_kvtransfer (see ../shared/DESIGN.md)."""

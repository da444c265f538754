"""The field's metadata rows, buffers, page placement and state helpers, over the core buffers."""

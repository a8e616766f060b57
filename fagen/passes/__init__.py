"""Program-level passes, each a pure function IR -> IR: bind_dtype, and the proven fusion."""

"""Program-level passes, each a pure function IR -> IR: bind_dtype, the proven fusion and the backward; and what
they proved, as values the backend prints (`lowering.Lowering`)."""

"""`shoal` on the command line: one module per command, each imported only when used."""

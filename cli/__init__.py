"""The `pagoda` command line: generate, serve and bench."""

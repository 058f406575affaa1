"""The `raypd` command line: up, config, status, down, bench."""

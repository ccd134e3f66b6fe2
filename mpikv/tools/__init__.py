"""The command line's tools: info and tune."""

"""Command-line interface: `tokenmill generate | chat | serve | bench | plan`."""

"""Command-line interface. Each module here with a ``register(subparsers)`` function adds one subcommand."""

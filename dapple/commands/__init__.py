"""One module per `dapple` subcommand; see `dapple.cli`."""

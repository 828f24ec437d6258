"""One module per `diagnose` subcommand: prepare_parser(parser) and run(args, parser) -> int."""
